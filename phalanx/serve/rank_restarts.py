"""`phalanx serve --nproc N`: the ranks started through PyTorch's elastic launcher, and started
again after one fails (`--max-restarts`, as `phalanx train`).

A rank that dies (SIGKILL, a crash, a collective past `--collective-timeout`) breaks the
group: rank 0 answers every request 503 and exits (`rank_loop.py`), the agent stops the others,
and this loop starts all ranks again on the same port (a `--port 0` is resolved to a free port
once, before the first start, so that clients find the restarted server where the first one
was). A user error (status 2), a stop by SIGTERM (0) or Ctrl-C (130), or a clean exit ends the
loop; a failure with no restarts left ends it with status 1 and one line saying why.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

from phalanx.ports import free_port

DEFAULT_MAX_RESTARTS = 3
"""As `phalanx train`'s with several workers."""


def max_restarts(configured: int | None, nproc: int) -> int:
    return configured if configured is not None else (DEFAULT_MAX_RESTARTS if nproc > 1 else 0)


def launch_ranks(entry, job) -> int:
    """Run `entry(job)` (serve/job.py's ServeJob) on job.nproc local ranks, again after each
    failure while restarts are left; the exit status."""
    restarts = job.max_restarts
    if job.port == 0 and restarts:
        job = dataclasses.replace(job, port=free_port())
    for attempt in range(restarts + 1):
        status, why = _launch_once(entry, job, attempt)
        if why is None:
            return status
        if attempt == restarts:
            spent = f"no restarts left (--max-restarts {restarts})" if restarts else "not restarted (--max-restarts 0)"
            print(f"phalanx: {why}; {spent}", file=sys.stderr, flush=True)
            return 1
        print(f"phalanx: {why}; restarting the server's ranks (restart {attempt + 1} of {restarts})",
              file=sys.stderr, flush=True)
    return 1


def _launch_once(entry, job, attempt: int) -> tuple[int, str | None]:
    """One elastic launch: (status, None) when it ended for good, or (1, why a rank failed)."""
    # Imported when run, not at the top: they bring in torch, which serve/job.py (this file's
    # max_restarts) and start-up need not wait for.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from phalanx.worker_group import start_elastic

    try:
        # A restart forks from a clean server process: this one has threads by now (worker_group.py).
        start_elastic(entry, (job,), job.nproc, job.device, quiet=True, grace_s=int(job.shutdown_grace) + 15,
                      run_id=f"phalanx-serve-{os.getpid()}-{attempt}", fresh=attempt > 0)
    except SignalException as stop:
        return (0 if stop.sigval == signal.SIGTERM else 130), None
    except KeyboardInterrupt:
        return 130, None
    except ChildFailedError as error:
        codes = {failure.exitcode for failure in error.failures.values()}
        if codes <= {2}:
            return 2, None  # a user error, printed by rank 0
        if codes <= {130}:
            return 130, None
        rank, failure = error.get_first_failure()
        if failure.exitcode < 0:
            return 1, f"rank {rank} of the server exited with signal {failure.signal_name()}"
        return 1, f"rank {rank} of the server exited with status {failure.exitcode}"
    return 0, None
