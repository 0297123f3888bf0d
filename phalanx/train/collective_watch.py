"""No silent hang: a collective that waits on a stuck or dead rank ends within
`--collective-timeout` seconds with an error that names the operation, and the rank where it
can be known.

- At every step boundary the ranks meet in `monitored_barrier` on a gloo group of their own
  (a few small messages; on CUDA too, where training talks NCCL). Rank 0 names each rank that
  did not arrive; the others say that rank 0 did not answer.
- Inside a step the process group's own timeout (the same seconds, set when the worker joins
  it) ends a waiting collective; `raise_if_collective_failure` turns that into a message naming the step.

The worker then fails with a non-zero status, which the launcher's restart logic treats like
any other dead worker.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time

import torch.distributed as dist

from phalanx.train.restarts import restart_count

STALL_ENV = "PHALANX_TEST_STALL"
"""Test hook: `RANK:STEP:SECONDS`; on the first attempt only (a restart must not stall again),
that rank sleeps SECONDS before the boundary barrier of step STEP (1-based, as in
metrics.jsonl), like a rank stuck in I/O or a hung kernel."""


class CollectiveTimeout(RuntimeError):
    """A collective did not complete: a rank is stuck or gone."""


def _stall_if_asked(rank: int, step: int) -> None:
    text = os.environ.get(STALL_ENV, "")
    if text and not restart_count():
        who, when, seconds = text.split(":")
        if int(who) == rank and int(when) == step:
            time.sleep(float(seconds))


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


class StepBarrier:
    """Call `barrier(step)` on every rank before step `step`; construct it on every rank, in
    order (it makes a process group)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        several = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) if several else None

    def __call__(self, step: int) -> None:
        _stall_if_asked(self.rank, step)
        if self.group is None:
            return
        try:
            with _native_stderr_silenced():
                dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=self.timeout_s),
                                       wait_all_ranks=True)
        except RuntimeError as error:
            raise CollectiveTimeout(
                f"rank {self.rank}: the step-boundary barrier before step {step} did not complete within "
                f"{self.timeout_s:g} s (--collective-timeout): {_first_line(error)}"
            ) from None


_BACKEND_FAILURE = ("timed out", "timeout", "connection closed", "connection reset", "pair closure", "nccl", "gloo")
"""What gloo's and NCCL's errors say (they arrive as plain RuntimeErrors, not DistError)."""


def raise_if_collective_failure(error: BaseException, step: int, timeout_s: float) -> None:
    """Called with an error caught around step `step`: a collective's timeout or a lost
    connection is raised again as a CollectiveTimeout naming the step; other errors return."""
    if isinstance(error, CollectiveTimeout):
        return
    text = str(error).lower()
    if isinstance(error, dist.DistError) or any(marker in text for marker in _BACKEND_FAILURE):
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveTimeout(
            f"rank {rank}: a collective of step {step} (forward, backward, gradient or loss reduction) failed or "
            f"waited past {timeout_s:g} s (--collective-timeout); another rank is stuck or gone: {_first_line(error)}"
        ) from error
