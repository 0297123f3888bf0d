"""What a worker needs to know about restarts (torch-free: the CLI reads it before torch).

A worker is a restart when the built-in launcher says so (`RESTART_ENV`, with the reason in
`REASON_ENV`; launcher side: the one restart policy, phalanx/launch/restart_policy.py) or when a user's own
`torchrun --max-restarts` restarted it (`TORCHELASTIC_RESTART_COUNT` > 0). A restart resumes
from the newest complete checkpoint when there is one, else starts fresh (`--resume auto`),
and rank 0 writes an event row to metrics.jsonl.

torchrun restarts every failure, a user error (exit status 2) too, and a restarted worker
would only meet it again. So under torchrun, rank 0 leaves the error in `USER_ERROR_FILE`
in the run directory; a restarted worker that finds it exits 2 at once, before importing
torch, until torchrun's restarts are spent. A first attempt removes an old one.
"""

from __future__ import annotations

import os
from pathlib import Path

from phalanx.launch.restart_policy import REASON_ENV, RESTART_ENV, restart_count, restart_reason  # noqa: F401 (the workers' names)

USER_ERROR_FILE = "user_error.txt"
FAULT_ENV = "PHALANX_TEST_FAULT"
"""Test hook: `RANK:STEP:SIGNAL` (e.g. `1:3:SIGKILL`): on the first attempt only, rank RANK
sends itself SIGNAL once STEP steps are done (after that step's checkpoint, if any), so tests
can kill a worker, or interrupt a run, at a known step. Read once by the worker's entry
(`injected_faults.InjectedFaults.from_env`), not by the loop."""


def restart_row(step: int) -> dict | None:
    """The metrics.jsonl event row of a restarted run resuming from `step` (None on a first attempt)."""
    count = restart_count()
    return {"event": "restart", "step": step, "restart": count, "reason": restart_reason()} if count else None


def resume_mode(resume: str) -> str:
    """A restart continues where the run stopped, or starts fresh if it never checkpointed."""
    return "auto" if restart_count() else resume


def earlier_user_error(run_dir: Path) -> str | None:
    """Under a torchrun restart: the user error an earlier attempt left (not retried). On a
    first attempt, rank 0 removes an old one and None is returned."""
    path = run_dir / USER_ERROR_FILE
    if not restart_count():
        if os.environ.get("RANK") == "0":
            path.unlink(missing_ok=True)
        return None
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def leave_user_error(run_dir: Path, message: str) -> None:
    """Under torchrun, rank 0 records the user error that ended this attempt."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / USER_ERROR_FILE).write_text(message + "\n")
    except OSError:
        pass  # an unusable --out: every restart meets the same error again, and says so
