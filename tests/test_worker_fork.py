"""No worker starts while the launcher is still forking its siblings.

The launcher forks the workers while its store's server thread runs; a worker that connects
sets that thread resolving the worker's address under glibc's resolver lock, and a sibling
forked in that moment inherits the lock held and hangs for good in `init_process_group`
(it hung a 4-process run of benchmarks/planner_local.py: phalanx/worker_group.py, AfterSiblingsForked).
The race itself is too rare to test; what closes it is testable exactly: every worker's
entry begins after the launcher's last fork. The launcher's forks are slowed here (a pause
after each), so a worker that did not wait would start a whole pause before the last fork.
"""

from __future__ import annotations

import os
import time

from phalanx.worker_group import start_elastic

PAUSE_S = 1.0
"""After each fork, in the launcher: far longer than a forked worker takes to reach its entry."""

_fork_times: list[float] | None = None
"""While a test launches: when the launcher forked each worker (monotonic, system-wide)."""


def _slow_fork_in_launcher() -> None:
    if _fork_times is not None:
        _fork_times.append(time.monotonic())
        time.sleep(PAUSE_S)


os.register_at_fork(after_in_parent=_slow_fork_in_launcher)  # a hook cannot be removed: idle outside the test


def _start_time() -> float:
    return time.monotonic()


def test_workers_start_only_after_the_last_fork():
    global _fork_times
    _fork_times = []
    try:
        started = start_elastic(_start_time, (), 2, "cpu", quiet=True)
        forks = list(_fork_times)
    finally:
        _fork_times = None
    assert len(forks) >= 2, f"the launcher forked {len(forks)} times; the test expects one fork per worker"
    last_fork = max(forks)
    early = {rank: round(last_fork - t, 3) for rank, t in started.items() if t < last_fork}
    assert not early, f"workers began this many seconds before the launcher's last fork: {early}"
