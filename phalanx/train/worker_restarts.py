"""Restarting the workers of `phalanx train` after a failure (`--max-restarts N`).

The restarts are a loop around one elastic launch each, here in the launcher, rather than the
elastic agent's own `max_restarts`: the agent restarts every failure, a user error (exit status
2) too, and it keeps the failure to itself, so the workers could neither write why they were
restarted into metrics.jsonl nor could the user get one clean line about it. Here each attempt
ends with the agent's result; a failure of a worker (a signal such as SIGKILL from the OOM
killer, a crash, a hang ended by the collective timeout) starts the next attempt with
`--resume auto` and the restart's number and reason in the workers' environment
(phalanx/train/restarts.py). A user error, a stop by SIGTERM/SIGINT (status 143/130) or a
success ends the loop. A user's own `torchrun --max-restarts` uses the agent's restarts; the
workers then see TORCHELASTIC_RESTART_COUNT.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from phalanx.checkpoint.store import latest_checkpoint
from phalanx.train.restarts import REASON_ENV, RESTART_ENV
from phalanx.train.stop_signal import GRACE_S, STOP_STATUS
from phalanx.worker_group import start_elastic

CONDITIONS = ("CollectiveTimeout:",)
"""Worker exceptions that describe the cluster's state, not a fault in the code."""

DEFAULT_MAX_RESTARTS = 3
"""With workers started by the launcher; one process run in the launcher's own has none."""


@dataclass
class Failure:
    """A worker that failed: why, in one line, and its traceback when it raised."""
    reason: str
    traceback: str = ""


def max_restarts(configured: int, nproc: int) -> int:
    """--max-restarts, or its default (-1): DEFAULT_MAX_RESTARTS with several workers, else 0."""
    return configured if configured >= 0 else (DEFAULT_MAX_RESTARTS if nproc > 1 else 0)


def describe(error) -> tuple[int, Failure | None]:
    """A ChildFailedError as (status, failure): status 2 (a user error, printed by rank 0),
    130/143 (stopped by a signal) or 1 with the failure of the first worker the agent saw fail."""
    codes = {failure.exitcode for failure in error.failures.values()}
    if codes <= {2}:
        return 2, None
    if codes <= set(STOP_STATUS.values()):
        return max(codes), None
    rank, failure = error.get_first_failure()
    if failure.exitcode < 0:
        return 1, Failure(f"worker rank {rank} exited with signal {failure.signal_name()}")
    message = failure.message
    if isinstance(message, dict):  # written by @record in the worker: the exception and its traceback
        text = message.get("message", "")
        # A stuck or lost rank is a condition, not a bug: its one line says all (no traceback).
        trace = "" if text.startswith(CONDITIONS) else message.get("extraInfo", {}).get("py_callstack", "")
        return 1, Failure(f"worker rank {rank} failed: {text}", trace)
    return 1, Failure(f"worker rank {rank} exited with status {failure.exitcode}")


def launch_once(entry, cfg, nproc: int, run_dir: str, rdzv_endpoint: str, attempt: int,
                job=None) -> tuple[int, Failure | None]:
    """One elastic launch of all workers, its elastic log lines silenced (the caller says
    what happened in one line): (status, failure). `job`: what the workers run
    (`phalanx.train.job`), or None for them to work out."""
    try:
        # The PHALANX_ variables (the restart's number and reason, test hooks) travel with the
        # arguments: a forkserver's workers do not see this process's environment.
        env = {name: value for name, value in os.environ.items() if name.startswith("PHALANX_")}
        # Across machines every launcher must name the same run; each counts its attempts alike
        # (a failure anywhere fails every node's workers).
        run = f"phalanx-{rdzv_endpoint}" if cfg.node_range[1] > 1 else f"phalanx-{os.getpid()}"
        start_elastic(entry, (asdict(cfg), job, run_dir, env), nproc, cfg.device, rdzv_endpoint, cfg.node_range, quiet=True,
                      grace_s=GRACE_S, run_id=f"{run}-{attempt}", fresh=attempt > 0)
    except SignalException as error:  # the agent passed it to the workers and waited for them
        return STOP_STATUS.get(error.sigval, 130), None
    except KeyboardInterrupt:
        return 130, None
    except ChildFailedError as error:
        return describe(error)
    return 0, None


def resume_hint(run_dir: Path) -> str:
    found = latest_checkpoint(run_dir)
    if found is None:
        return "no checkpoint was written"
    return f"last checkpoint: step {found[0]}; continue with: phalanx train --out {run_dir} --resume auto"


def launch_with_restarts(entry, cfg, nproc: int, run_dir: str, rdzv_endpoint: str, restarts: int,
                         job_for=lambda cfg: None, *, group: int | None = None) -> int:
    """Launch the workers, and again after each failure, at most `restarts` times; the exit
    status of the last attempt (1 when a failure used up the restarts). `job_for(cfg)`: the
    job of each attempt, worked out again for a restart (it resumes from a newer checkpoint).
    `group`: these workers are one replica group (phalanx/train/replica_groups.py); a restart
    rejoins the other groups, which receive it into their next quorum and send it their state."""
    label = "" if group is None else f"replica group {group}: "
    saved = {name: os.environ.get(name) for name in (RESTART_ENV, REASON_ENV)}
    try:
        for attempt in range(restarts + 1):
            status, failure = launch_once(entry, cfg, nproc, run_dir, rdzv_endpoint, attempt, job_for(cfg))
            if failure is None:
                return status
            if failure.traceback:
                print(failure.traceback.rstrip(), file=sys.stderr)
            if attempt == restarts:
                spent = f"no restarts left (--max-restarts {restarts})" if restarts else "not restarted (--max-restarts 0)"
                print(f"phalanx: {label}{failure.reason}; {spent}; {resume_hint(Path(run_dir))}", file=sys.stderr)
                return 1
            found = latest_checkpoint(Path(run_dir))
            where = f"step {found[0]}" if found else "the start (no checkpoint yet)"
            if group is not None:
                where = "its peers' live state"
            print(f"phalanx: {label}{failure.reason}; restarting from {where} (restart {attempt + 1} of {restarts})",
                  file=sys.stderr)
            os.environ[RESTART_ENV], os.environ[REASON_ENV] = str(attempt + 1), failure.reason
            cfg = cfg.replace(resume="auto")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 1
