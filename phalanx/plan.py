"""A parallel layout as plain data, and the `--plan` string grammar that writes it.

    dp=2,tp=2,pp=2,ep=2,zero=3,sp=true,schedule=interleaved,virtual=2,microbatches=8
    dp=2,cp=4             (each sequence split over 4 context-parallel ranks)
    pp=2,split=3:1        (hand-given layers per pipeline stage)
    dp=4,zero=3,offload=true,param_dtype=bf16,reduce_dtype=fp32

The planner emits this same dataclass, so a chosen plan can be printed, saved, edited and run.
Rank order (documented in docs/layout.md): tp is innermost (fastest links), then cp, then dp,
then pp outermost; ep is carved out of the dp x cp ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass

from phalanx import layout_rules as rules
from phalanx.errors import UserError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
RECOMPUTE = ("none", "selective", "full")
ZERO_LEVELS = (0, 2, 3)
DTYPES = ("bf16", "fp32")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How one training job is spread over `dp * cp * tp * pp` processes."""

    dp: int = 1
    """Data-parallel degree: copies (or shards, with zero) of the model, each on its batch slice."""
    tp: int = 1
    """Tensor-parallel degree: each layer's matrices split across this many ranks."""
    pp: int = 1
    """Pipeline-parallel degree: number of stages."""
    cp: int = 1
    """Context-parallel degree: each sequence cut into 2 x cp chunks, two per rank, attention
    over the whole sequence by gathering keys and values over the cp ranks
    (`phalanx.parallel.context_parallel`). Weights are replicated over cp, so gradients reduce
    and zero levels shard over dp x cp."""
    cp_ring: bool = False
    """With cp > 1: keys and values passed around a ring of the cp ranks, each step's transfer
    overlapped with attention on the keys at hand, and their gradients passed back the same way
    (`phalanx.parallel.context_parallel_ring`). False: one all-gather per layer (Llama 3's
    choice), overlapped with the chunks' diagonal blocks only. The planner picks per layout."""
    ep: int = 1
    """Expert-parallel degree, carved out of the dp x cp ranks (must divide dp x cp), or with ep_over_tp out
    of the dp x cp x tp ranks (must divide dp x cp x tp)."""
    ep_over_tp: bool = False
    """MoE parallel folding: the ep group is drawn from the dp x tp ranks of a stage and each tp
    rank sends 1/tp of an MoE layer's token-expert assignments, so tp ranks no longer run the
    same experts on the same tokens (`phalanx.parallel.expert_fold`). False: every tp rank
    routes and computes all of its dp rank's assignments (tp-fold duplicated expert work)."""
    zero: int = 0
    """What data parallelism shards over dp (FSDP2): 0 nothing (replicated, DDP); 2 gradients and
    optimizer state, parameters gathered in forward and kept through backward
    (`reshard_after_forward=False`); 3 parameters too, re-gathered in backward. ZeRO-1 is not
    offered: PyTorch's `ZeroRedundancyOptimizer` checkpoints do not reshard through DCP."""
    offload: bool = False
    """With zero=3: parameters, gradients and optimizer state live on the host (FSDP2
    `CPUOffloadPolicy`); the optimizer steps on the CPU."""
    param_dtype: str = ""
    """bf16 or fp32: the dtype of the weights the forward computes with, in every layout (FSDP2
    gathers them so, `MixedPrecisionPolicy`; elsewhere bf16 copies of the fp32 masters,
    `phalanx.parallel.mixed_precision`); empty = follow `--dtype`. fp32 under `--dtype bf16` is
    autocast over fp32 weights."""
    reduce_dtype: str = ""
    """fp32 or bf16: the dtype gradients are reduced in over dp (FSDP2 `MixedPrecisionPolicy`,
    DDP's `bf16_compress_hook`); empty = fp32."""
    replicate: int = 1
    """With zero=2 or 3: HSDP, replicate over this many groups and shard within each (divides dp)."""
    sp: bool = False
    """Sequence parallelism for the norm regions (needs tp > 1)."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved, zbv or dualpipev."""
    virtual: int = 1
    """Model chunks per pipeline rank (interleaved uses >= 2, zbv and dualpipev use 2). A `--plan`
    string that names one of those schedules without `virtual` gets virtual=2."""
    microbatches: int = 0
    """Micro-batches per optimizer step per data-parallel rank; 0 picks a default (pp, or 1)."""
    recompute: str = "none"
    """Activation checkpointing: none, selective or full."""
    recompute_layers: int = 0
    """With recompute: checkpoint only the first this many blocks of each model chunk (of the
    model without pp), the rest keep their activations; 0 = every block. Between none and
    full: the fewest recomputed layers that fit in memory."""
    split: str = ""
    """Transformer layers per pipeline stage by hand, `a:b:...` (pp x virtual counts, in stage
    order); empty = balanced by estimated cost (see `phalanx.parallel.stage_split`)."""
    fsdp: InitVar[bool] = False
    """The older spelling of zero=3: `Plan(fsdp=True)` is `Plan(zero=3)`. Not a field: read
    `plan.fsdp` (zero == 3), and change a plan with `Plan.replace`, not `dataclasses.replace`."""

    def __post_init__(self, fsdp: bool) -> None:
        if fsdp and self.zero not in (0, 3):
            raise UserError(f"invalid plan: fsdp=true means zero=3, which contradicts zero={self.zero}")
        if fsdp:
            object.__setattr__(self, "zero", 3)

    def replace(self, **changes) -> "Plan":
        # dataclasses.replace would pass fsdp=self.fsdp and turn zero=0 back into 3.
        return dataclasses.replace(self, **{"fsdp": False, **changes})

    @property
    def shards_dp(self) -> bool:
        """Whether data parallelism shards anything (zero 2 or 3) over dp."""
        return self.zero >= 2

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def weight_replicas(self) -> int:
        """Ranks that hold the same weights and different tokens: dp x cp (gradients are
        reduced, zero levels sharded and experts spread over them)."""
        return self.dp * self.cp

    @property
    def num_microbatches(self) -> int:
        return self.microbatches or max(1, self.pp * (2 if self.pp > 1 else 1))

    def to_string(self) -> str:
        """The shortest `--plan` string that parses back to this plan."""
        default = Plan()
        parts = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value != getattr(default, field.name):
                parts.append(f"{field.name}={str(value).lower() if isinstance(value, bool) else value}")
        return ",".join(parts) or "dp=1"

    def __str__(self) -> str:
        return self.to_string()

    def validate(self, world_size: int | None = None) -> "Plan":
        """Check the plan on its own and against `world_size` processes; return it."""
        problems = []
        for name in ("dp", "cp", "tp", "pp", "ep", "replicate", "virtual"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be at least 1")
        if self.microbatches < 0:
            problems.append(f"microbatches={self.microbatches} must be at least 1")
        if problems:
            raise UserError("invalid plan: " + "; ".join(problems))
        if problem := rules.ep_dp_problem(self.ep, dp=self.dp, tp=self.tp, over_tp=self.ep_over_tp, cp=self.cp):
            problems.append(problem)
        if self.zero == 1:
            problems.append("zero=1 (optimizer state only) is not offered: PyTorch's ZeroRedundancyOptimizer "
                            "checkpoints do not reshard through DCP; use zero=2 (gradients and optimizer state)")
        elif self.zero not in ZERO_LEVELS:
            problems.append(f"zero={self.zero} must be 0, 2 or 3")
        if self.offload and self.zero != 3:
            problems.append(f"offload=true needs zero=3 (FSDP2 offloads sharded parameters), got zero={self.zero}")
        elif self.offload and self.weight_replicas == 1:
            problems.append("offload=true needs dp > 1 (FSDP2 over the data-parallel ranks offloads), got dp=1")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in ("", *DTYPES):
                problems.append(f"{name}={getattr(self, name)!r} is not one of {', '.join(DTYPES)}")
        if self.reduce_dtype == "bf16" and self.weight_replicas == 1:
            problems.append("reduce_dtype=bf16 needs dp > 1 (with dp=1 no gradient is reduced)")
        if self.replicate > 1 and not self.shards_dp:
            problems.append(f"replicate={self.replicate} (HSDP) needs zero=2 or 3 (fsdp=true), got zero={self.zero}")
        if self.dp % self.replicate:
            problems.append(f"replicate={self.replicate} must divide dp={self.dp}")
        if self.cp_ring and self.cp == 1:
            problems.append("cp_ring=true needs cp > 1 (it passes keys and values around the cp ranks)")
        if self.sp and self.tp == 1:
            problems.append("sp=true needs tp > 1 (sequence parallelism splits along the tp group)")
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            problems.append(f"recompute={self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if self.recompute_layers < 0:
            problems.append(f"recompute_layers={self.recompute_layers} must be 0 (every block) or more")
        elif self.recompute_layers and self.recompute == "none":
            problems.append(f"recompute_layers={self.recompute_layers} needs recompute=full or selective")
        for problem in (rules.virtual_problem(self.schedule, pp=self.pp, virtual=self.virtual),
                        rules.microbatches_problem(self.schedule, pp=self.pp, microbatches=self.num_microbatches)):
            if problem:
                problems.append(problem)
        if self.split and self.pp == 1:
            problems.append(f"split={self.split} divides layers between pipeline stages, but pp=1")
        if world_size is not None and self.world_size != world_size:
            problems.append(
                f"dp={self.dp}{f' x cp={self.cp}' if self.cp > 1 else ''} x tp={self.tp} x pp={self.pp} = {self.world_size}, "
                f"but {world_size} process{' was' if world_size == 1 else 'es were'} started"
            )
        if problems:
            raise UserError("invalid plan: " + "; ".join(problems))
        return self


# The InitVar default above became a class attribute; `plan.fsdp` reads the zero level instead.
Plan.fsdp = property(lambda self: self.zero == 3, doc="zero=3 (the older `fsdp=true`).")

_FIELDS = {f.name: f for f in dataclasses.fields(Plan)}
ALIASES = {"fsdp": "zero"}
"""Older keys still read: fsdp=true is zero=3 (fsdp=false: zero=0)."""


def _convert(key: str, raw: str):
    kind = bool if key == "fsdp" else type(getattr(Plan(), key))
    if kind is bool:
        if raw.lower() in ("true", "1", "yes", "on"):
            return True
        if raw.lower() in ("false", "0", "no", "off"):
            return False
        raise UserError(f"plan key {key}={raw!r} must be true or false")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise UserError(f"plan key {key}={raw!r} must be an integer") from None
    return raw.lower()


def key_values(text: str, *, what: str = "plan") -> list[tuple[str, str]]:
    """`k=v,k=v` as (key, raw value) pairs, keys lower-cased: the one reader of both `--fix`
    grammars (the training plan's, `parse_plan`, and the serving planner's,
    planner/serve/search.parse_serve_fix) and of `--plan`. An item without `=` or a value, or a
    key given twice, is an error naming `what` (plan, --fix)."""
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip().lower()
        if not sep or not raw.strip():
            raise UserError(f"{what} item {item!r} is not of the form key=value")
        if any(key == seen for seen, _ in pairs):
            raise UserError(f"{what} key {key!r} is given twice")
        pairs.append((key, raw.strip()))
    return pairs


def parse_plan(text: str, *, extra_keys: tuple[str, ...] = ()) -> tuple[Plan, dict[str, str]]:
    """Parse `k=v,k=v` into a Plan; keys named in `extra_keys` are returned raw beside it.

    The planner passes extra_keys=("mbs",) for its micro-batch size knob; the trainer none.
    """
    values: dict[str, object] = {}
    extras: dict[str, str] = {}
    for key, raw in key_values(text):
        if key in extra_keys:
            extras[key] = raw
        elif key in _FIELDS or key in ALIASES:
            values[key] = _convert(key, raw)
        else:
            valid = ", ".join(dict.fromkeys([*_FIELDS, *ALIASES, *extra_keys]))  # the planner's extras repeat zero
            raise UserError(f"unknown plan key {key!r}; valid keys: {valid}")
    if "fsdp" in values:
        fsdp = values.pop("fsdp")
        if "zero" in values and (values["zero"] == 3) != fsdp:
            raise UserError(f"plan key fsdp={str(fsdp).lower()} contradicts zero={values['zero']}")
        values["zero"] = 3 if fsdp else values.get("zero", 0)
    if values.get("schedule") in rules.MULTI_CHUNK_SCHEDULES and "virtual" not in values:
        values["virtual"] = 2  # the multi-chunk schedules' usual (and for zbv/dualpipev only) value
    return Plan(**values), extras


def plan_from_string(text: str, world_size: int | None = None) -> Plan:
    """Parse and validate a `--plan` string for the trainer."""
    plan, _ = parse_plan(text)
    return plan.validate(world_size)


def weights_view(plan: Plan) -> Plan:
    """`plan` as the weights see it: the dp x cp ranks as one data-parallel axis (cp ranks hold
    the same parameters and different tokens, so gradients reduce, zero levels shard and
    experts spread over dp x cp; parallel/mesh.py)."""
    return plan if plan.cp == 1 else plan.replace(dp=plan.dp * plan.cp, cp=1)


def parse_split(text: str, n_stages: int, n_layers: int) -> list[int]:
    """The plan's hand-given `split=a:b:...` (layers per stage), checked against the model."""
    try:
        counts = [int(part) for part in text.split(":")]
    except ValueError:
        raise UserError(f"split={text!r} must be layer counts separated by ':', e.g. split=3:3:2") from None
    if len(counts) != n_stages:
        raise UserError(f"split={text} gives {len(counts)} stages, but pp x virtual = {n_stages}")
    if any(c < 1 for c in counts):
        raise UserError(f"split={text}: every stage needs at least one layer")
    if sum(counts) != n_layers:
        raise UserError(f"split={text} adds up to {sum(counts)} layers, but the model has {n_layers}")
    return counts
