"""A training run's settings: one typed dataclass, filled from a TOML file and flags.

Precedence: built-in defaults < `--config run.toml` < command-line flags. Every key of the
TOML file is a field name below; an unknown key is an error that names the valid ones.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.errors import UserError
from phalanx.planner.layout import Workload


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = "small"
    """Model preset name (see `phalanx.model.config.PRESETS`), or a Hugging Face model
    directory or config.json (`phalanx.model.hf_config`)."""
    init: str = "auto"
    """'auto': the model directory's weights when it has them, else drawn from the seed;
    'random': drawn from the seed."""
    data: str = ""
    """Prepared directory (`phalanx prepare`), text file, folder of text files, or `.bin` of
    uint16 tokens; empty = Python's stdlib."""
    tokenizer: str = ""
    """`tokenizer.json` (or a folder holding one) or 'bytes'; empty = the model directory's
    tokenizer.json, else the one a prepared --data was made with, else bytes."""
    plan: str = ""
    """Parallel layout in the `--plan` grammar; empty = data parallel over all processes."""
    cluster: str = ""
    """What `--plan auto` plans for: a preset name or a cluster file; empty = this machine (its
    calibration if `phalanx calibrate` wrote one, else the preset matching its GPUs, else `local`)."""
    nproc: int = 0
    """Local worker processes; 0 = as many as the plan names, else one per GPU, else one per
    CPU core (at most 8, and dividing global_batch)."""
    nnodes: str = "1"
    """Machines: N, or MIN:MAX for an elastic run that goes on when nodes leave or join (nproc
    is then per node; the plan's dp follows the world size, see train/world_change.py)."""
    steps: int = 300
    global_batch: int = 16
    """Sequences per optimizer step, whatever the layout."""
    seq_len: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dtype: str = "fp32"
    """'fp32' or 'bf16' (mixed precision: bf16 compute weights; the fp32 weights are the masters,
    with fp32 gradients and optimizer state; `phalanx.parallel.mixed_precision`)."""
    seed: int = 0
    out: str = ""
    """Run directory; empty = runs/<model>-<date>-<time>."""
    eval_every: int = 100
    eval_batches: int = 4
    ckpt_every: int = 100
    """Checkpoint every N steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    sync_checkpoint: bool = False
    """Save checkpoints in the loop; by default they are written in the background (DCP
    async_save) while training goes on, and the loop waits only for the copy to CPU memory."""
    collective_timeout: float = 600.0
    """Seconds a collective may wait for the other ranks before the worker fails with an error
    naming the step (and, after a timeout, the missing ranks)."""
    resume: str = ""
    """'' = a fresh run (refused if `out` already holds one); 'must' = continue from the newest
    complete checkpoint in `out` (an error if there is none); 'auto' = continue when there is
    one, else start fresh (what a restarted job wants). The boolean true means 'must'."""
    max_bad_steps: int = 5
    """Stop after this many steps in a row whose loss or gradient norm is not finite (each is
    skipped: no update); the last good state is checkpointed."""
    max_restarts: int = -1
    """Restarts of the workers after one fails (a signal, a crash, a collective timeout), each
    resuming from the newest complete checkpoint; a user error is never retried. -1 = the
    default: 3 when the launcher starts worker processes, 0 for one process run in its own."""
    replica_groups: int = 1
    """Data-parallel replica groups (over all machines), each a fault domain of nproc / (groups
    per machine) processes that runs the plan inside it; a failed group restarts and rejoins
    from its peers while the others keep training (torchft, the `ft` extra; `parallel/fault_tolerance.py`). 1 = none."""
    lighthouse: str = ""
    """With replica_groups: HOST:PORT of a torchft lighthouse already running; empty = the
    launcher starts one (on one machine only: with nnodes > 1 it is required)."""
    sample_tokens: int = 200
    sample_prompt: str = "def "
    device: str = "auto"
    """'auto' (CUDA if present), 'cpu' or 'cuda'."""
    progress: bool = True
    plot: bool = True
    """Draw loss.png (and experts.png for MoE models) at the end; off (`--no-plot`), metrics.jsonl
    and TensorBoard still hold every figure. A plot costs about 0.1 s of CPU: a large share of a
    seconds-long run (the test suite's thousands of tiny runs leave it off)."""
    expert_slots: int = 0
    """Physical expert slots per MoE layer over the ep group (>= experts, a multiple of ep);
    0 = one slot per expert, the plain ep layout (docs/expert_slots.md)."""
    rebalance_every: int = 0
    """Re-plan the expert slots from the moving load average every K steps, moving weights and
    optimizer state to their new slots; 0 = never."""
    compile: bool = False
    """`torch.compile` each transformer block (inductor, no graph breaks); `parallel/compile.py`."""
    float8: bool = False
    """torchao float8 training of the blocks' linear layers (tensorwise scaling; the `float8`
    extra); fast only on GPUs with float8 matmuls, numerics only elsewhere; `parallel/float8.py`."""
    doc_mask: bool = False
    """Attention stays inside each document of a packed sequence (the document starts a prepared
    directory records); with or without cp; `parallel/context_parallel.py`."""
    adapt: bool = True
    """Data-parallel ranks share the global batch in proportion to their measured speeds,
    re-decided when speeds shift (`phalanx/adapt_policy.py`; plain dp only, docs/layout.md:
    Adapting to slow ranks); false (`--no-adapt`): equal shares."""
    threads: int = 0
    """torch intra-op threads per worker; 0 = the user's OMP_NUM_THREADS, else the cores this
    process may use divided among the local workers (`phalanx/threads.py`)."""
    def __post_init__(self) -> None:
        if isinstance(self.resume, bool):  # TOML `resume = true` and older callers
            object.__setattr__(self, "resume", "must" if self.resume else "")

    @property
    def node_range(self) -> tuple[int, int]:
        """(min, max) machines of `nnodes`; call validate first."""
        low, _, high = str(self.nnodes).partition(":")
        return int(low), int(high or low)

    @property
    def elastic(self) -> bool:
        """Whether the number of machines (so the world size) may change during the run."""
        low, high = self.node_range
        return low != high

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def validate(self) -> "TrainConfig":
        problems = []
        for name in ("steps", "global_batch", "seq_len", "eval_batches", "keep_checkpoints", "max_bad_steps", "replica_groups"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("nproc", "warmup_steps", "ckpt_every", "eval_every", "sample_tokens", "expert_slots", "rebalance_every"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must not be negative")
        if self.threads < 0:
            problems.append(f"threads={self.threads} must be >= 0 (0: chosen from the cores this process may use)")
        if self.max_restarts < -1:
            problems.append(f"max_restarts={self.max_restarts} must not be negative")
        if self.dtype not in ("fp32", "bf16"):
            problems.append(f"dtype={self.dtype!r} must be 'fp32' or 'bf16'")
        if self.init not in ("auto", "random"):
            problems.append(f"init={self.init!r} must be 'auto' or 'random'")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"device={self.device!r} must be 'auto', 'cpu' or 'cuda'")
        if self.resume not in ("", "must", "auto"):
            problems.append(f"resume={self.resume!r} must be 'must' or 'auto'")
        low, sep, high = str(self.nnodes).partition(":")
        if not (low.isdigit() and (high.isdigit() or not sep) and 1 <= int(low) <= int(high or low)):
            problems.append(f"nnodes={self.nnodes!r} must be N or MIN:MAX with 1 <= MIN <= MAX")
        if not 0 < self.collective_timeout < math.inf:
            problems.append(f"collective_timeout={self.collective_timeout} must be a positive number of seconds")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            if not math.isfinite(getattr(self, name)):
                problems.append(f"{name}={getattr(self, name)} must be a finite number")
        if self.lr <= 0 or self.min_lr < 0:
            problems.append("lr must be positive and min_lr not negative")
        if problems:
            raise UserError("invalid settings: " + "; ".join(problems))

        Workload(global_batch=self.global_batch, seq_len=self.seq_len)
        return self


FIELDS = {field.name: field for field in dataclasses.fields(TrainConfig)}


def _check_type(key: str, value: Any, source: str) -> Any:
    expected = type(getattr(TrainConfig(), key))
    if key == "resume" and isinstance(value, bool):
        return value  # true = 'must', false = a fresh run (TrainConfig.__post_init__)
    if key == "nnodes" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # nnodes = 2 as well as nnodes = "1:2"
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not expected:
        raise UserError(f"{source}: {key} = {value!r} should be of type {expected.__name__}")
    return value


def load_config(path: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """Defaults, then the TOML file at `path`, then `overrides` (already typed, None = unset)."""
    values: dict[str, Any] = {}
    if path:
        file = Path(path)
        if file.is_dir():
            raise UserError(f"config file {path!r} is a folder; --config takes a TOML file")
        if not file.is_file():
            raise UserError(f"config file {path!r} does not exist")
        try:
            raw = tomllib.loads(file.read_text())
        except OSError as error:
            raise UserError(f"config file {path!r} cannot be read ({error.strerror or error})") from None
        except UnicodeDecodeError:
            raise UserError(f"config file {path!r} is not text (a binary file?); --config takes a TOML file") from None
        except tomllib.TOMLDecodeError as error:
            raise UserError(f"config file {path!r} is not valid TOML: {error}") from None
        for key, value in raw.items():
            if key not in FIELDS:
                raise UserError(f"unknown key {key!r} in {path}; valid keys: {', '.join(FIELDS)}")
            values[key] = _check_type(key, value, path)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return TrainConfig(**values).validate()
