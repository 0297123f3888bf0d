"""No silent hang: a collective that waits on a stuck or dead rank ends within
`--collective-timeout` seconds with an error that names the operation, and the rank where it
can be known.

- Every collective of a step runs under the process group's own timeout (the same seconds, set
  when the worker joins it); nothing is paid per step for watching: the step's one small
  collective (`step_sync.py`) is also its liveness check.
- Only once a collective has timed out, the ranks meet in `monitored_barrier` on a gloo group of
  their own (`StuckRankWatch.missing`), so rank 0 can name each rank that did not arrive; the
  others say that rank 0 did not answer. That barrier waits `DIAGNOSIS_S` at most (the healthy
  ranks time out of their collective about together: they entered it about together).
- `raise_if_collective_failure` turns a failed collective into a CollectiveTimeout naming the
  step, and, after a timeout, the missing ranks.

The worker then fails with a non-zero status, which the launcher's restart logic treats like
any other dead worker. On CUDA a timed-out NCCL collective is ended by PyTorch's NCCL watchdog,
which tears the worker down itself (its own message names the collective), so the barrier that
names the rank runs where the timeout reaches Python: gloo (CPU runs).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch.distributed as dist

from phalanx.worker_group import bound_every_group  # noqa: F401 (the training loop's name for it)

STALL_ENV = "PHALANX_TEST_STALL"
"""Test hook: `RANK:STEP:SECONDS`; on the first attempt only (a restart must not stall again),
that rank sleeps SECONDS before step STEP (1-based, as in metrics.jsonl), like a rank stuck in
I/O or a hung kernel. Read by `injected_faults.InjectedFaults.from_env`."""
DIAGNOSIS_S = 30.0
"""Longest wait (capped by --collective-timeout) of the barrier that counts the ranks after a
timeout: the healthy ranks reach it within their skew into the collective that timed out."""


class CollectiveTimeout(RuntimeError):
    """A collective did not complete: a rank is stuck or gone.

    `others_may_name_s`: when this rank only saw a connection close, the seconds another rank
    may still spend counting the ranks after its own timeout; the launcher's worker waits that
    long for the agent to stop it, so the error that names the stuck rank is the one reported."""
    def __init__(self, message: str, others_may_name_s: float = 0.0):
        super().__init__(message)
        self.others_may_name_s = others_may_name_s


@contextlib.contextmanager
def _native_stderr_silenced():
    """gloo logs a failed monitored barrier to the process's stderr from C++ (two lines that
    the raised error repeats); with a rank killed, every survivor would print them around the
    launcher's one-line report. The file descriptor is pointed at /dev/null for the barrier."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class StuckRankWatch:
    """The gloo group on which the ranks are counted after a timeout; construct it on every
    rank, in order (it makes a process group). Costs nothing until `missing` is called."""
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.wait_s = min(timeout_s, DIAGNOSIS_S)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        several = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) if several else None

    def missing(self) -> str:
        """gloo's line naming the ranks that did not reach the barrier within `wait_s` (rank 0),
        or saying that rank 0 did not answer (the others); "" when every rank came. The other
        ranks wait twice as long, so that rank 0, which can name the missing ones, fails first."""
        if self.group is None:
            return ""
        wait = self.wait_s if self.rank == 0 else 2 * self.wait_s
        try:
            with _native_stderr_silenced():
                dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=wait), wait_all_ranks=True)
        except RuntimeError as error:
            return _first_line(error)
        return ""


_BACKEND_FAILURE = ("timed out", "timeout", "connection closed", "connection reset", "pair closure", "nccl", "gloo")
"""What gloo's and NCCL's errors say (they arrive as plain RuntimeErrors, not DistError)."""
_TIMED_OUT = ("timed out", "timeout")


def raise_if_collective_failure(error: BaseException, step: int, timeout_s: float,
                                watch: StuckRankWatch | None = None) -> None:
    """Called with an error caught around step `step`: a collective's timeout or a lost
    connection is raised again as a CollectiveTimeout naming the step (after a timeout, with
    `watch`, the ranks that are missing); other errors return."""
    if isinstance(error, CollectiveTimeout):
        return
    text = str(error).lower()
    if not (isinstance(error, dist.DistError) or any(marker in text for marker in _BACKEND_FAILURE)):
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if watch is not None and any(marker in text for marker in _TIMED_OUT):
        missing = watch.missing()
        counted = (f"; the ranks then counted within {watch.wait_s:g} s: {missing}" if missing else
                   f"; every rank then reached the barrier that counts them within {watch.wait_s:g} s (one was slow, not gone)")
        raise CollectiveTimeout(
            f"rank {rank}: a collective of step {step} waited past {timeout_s:g} s (--collective-timeout){counted}"
        ) from None
    raise CollectiveTimeout(
        f"rank {rank}: a collective of step {step} (forward, backward, gradient or loss reduction) failed or "
        f"waited past {timeout_s:g} s (--collective-timeout); another rank is stuck or gone: {_first_line(error)}",
        others_may_name_s=watch.wait_s if watch is not None else 0.0,
    ) from error
