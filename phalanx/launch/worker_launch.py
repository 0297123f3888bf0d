"""The one launcher of worker processes for `phalanx train`, `serve` and `generate`.

A command gives its worker's main function (module-level, so that a forkserver's or a spawned
worker can find it by name) and the plain data it runs (the job the launcher worked out);
`launch_workers` starts `nproc` local workers through PyTorch's elastic launcher
(phalanx/worker_group.py's `start_elastic`), each running `elastic_entry`, and starts them all
again after a failure under the one restart policy (phalanx/launch/restart_policy.py). What each
command adds is only what is its own: where a restart of training resumes from, the server's
port kept across restarts.

The worker side is the same for every command: `elastic_entry` puts back the launcher's
`PHALANX_` variables (a forkserver's child has the server's environment, not the launcher's),
runs `main(*args)` and exits with its status; an exception goes to the agent with its
traceback (`record`), which `describe` turns into the failure's one line.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from phalanx.launch.restart_policy import CONDITIONS, STOP_STATUS, Failure, run_attempts
from phalanx.restart_timeline import mark
from phalanx.worker_group import start_elastic, stop_warm_forkserver, warm_forkserver


def elastic_entry(main: Callable[..., int], args: tuple, phalanx_env: dict | None = None) -> None:
    """Every launched worker: `main(*args)`, its status the process's exit status.

    A worker that failed (an exception, or status 1) leaves at once, without the interpreter's
    shutdown: that joins every thread left, and a thread blocked on a dead rank (a background
    checkpoint save's collective, a torchft wait) would keep the process alive until the
    elastic agent kills it, after its fixed 30 s (torch 2.13's `_stop_workers`), the restart
    and any replica group's quorum waiting meanwhile. Its state is discarded anyway; a restart
    reads only complete checkpoints."""
    if phalanx_env is not None:
        for name in [n for n in os.environ if n.startswith("PHALANX_") and n not in phalanx_env]:
            del os.environ[name]
        os.environ.update(phalanx_env)
    mark("worker_start", os.environ.get("RANK", ""))
    try:
        status = _recorded(main, args)
    except Exception:  # `record` has written it, with its traceback, for the agent
        _leave(FAILED_STATUS)
    if status == FAILED_STATUS:
        _leave(status)
    if status:
        sys.exit(status)


FAILED_STATUS = 1


@record  # a worker's exception and traceback go to the agent (`describe` prints them once)
def _recorded(main: Callable[..., int], args: tuple) -> int:
    return main(*args)


def _leave(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def worker_name(rank: int) -> str:
    return f"worker rank {rank}"


def first_failure(error: ChildFailedError) -> tuple[int, object]:
    """(rank, failure) the agent saw fail first. Its timestamps are whole seconds, taken one
    worker after another, so workers that failed within one of its monitor passes tie or differ
    by one; among those, one killed by a signal or that recorded an error comes before one that
    only exited with a status: a worker that leaves because another died (a replica group's,
    parallel/broken_group.py, within the same 0.1 s pass; or one whose collective failed), which
    torch's own choice, the lowest rank, could name instead of the dead one."""
    first = min(failure.timestamp for failure in error.failures.values())
    tied = [(rank, failure) for rank, failure in sorted(error.failures.items()) if failure.timestamp <= first + 1]
    return min(tied, key=lambda item: (item[1].exitcode > 0 and not isinstance(item[1].message, dict), item[0]))


def describe(error: ChildFailedError, who: Callable[[int], str] = worker_name) -> tuple[int, Failure | None]:
    """A ChildFailedError as (status, failure): status 2 (a user error, printed by rank 0),
    130/143 (stopped by a signal) or 1 with the failure of the first worker the agent saw fail."""
    codes = {failure.exitcode for failure in error.failures.values()}
    if codes <= {2}:
        return 2, None
    if codes <= set(STOP_STATUS.values()):
        return max(codes), None
    rank, failure = first_failure(error)
    if failure.exitcode < 0:
        return 1, Failure(f"{who(rank)} exited with signal {failure.signal_name()}")
    message = failure.message
    if isinstance(message, dict):  # written by `record` in the worker: the exception and its traceback
        text = message.get("message", "")
        trace = "" if text.startswith(CONDITIONS) else message.get("extraInfo", {}).get("py_callstack", "")
        return 1, Failure(f"{who(rank)} failed: {text}", trace)
    return 1, Failure(f"{who(rank)} exited with status {failure.exitcode}")


def launch_attempt(main: Callable[..., int], args: tuple, nproc: int, device: str, attempt: int, *,
                   rdzv_endpoint: str = "", nodes: tuple[int, int] = (1, 1), grace_s: int = 30, run_id: str = "",
                   who: Callable[[int], str] = worker_name) -> tuple[int, Failure | None]:
    """One elastic launch of all workers, the agent's own log lines silenced (the policy says
    what happened in one line): (status, failure). A restart (`attempt` > 0) forks its workers
    from a clean forkserver: this process has threads by now (worker_group.py)."""
    # The PHALANX_ variables (the restart's number and reason, test hooks) travel with the
    # arguments: a forkserver's workers do not see this process's environment.
    env = {name: value for name, value in os.environ.items() if name.startswith("PHALANX_")}
    mark("attempt_start", str(attempt))
    try:
        start_elastic(elastic_entry, (main, args, env), nproc, device, rdzv_endpoint, nodes, quiet=True,
                      grace_s=grace_s, run_id=f"{run_id or f'phalanx-{os.getpid()}'}-{attempt}", fresh=attempt > 0,
                      preload=main.__module__)
    except SignalException as error:  # the agent passed it to the workers and waited for them
        return STOP_STATUS.get(error.sigval, 130), None
    except KeyboardInterrupt:
        return 130, None
    except ChildFailedError as error:
        mark("attempt_failed", str(attempt))
        return describe(error, who)
    return 0, None


def launch_workers(main: Callable[..., int], args_for: Callable[[int], tuple], nproc: int, device: str, restarts: int,
                   *, label: str = "", restarting: Callable[[], str] = lambda: "restarting",
                   after: Callable[[], str] = lambda: "", flag: str | None = "--max-restarts", rdzv_endpoint: str = "",
                   nodes: tuple[int, int] = (1, 1), grace_s: int = 30, run_id: str = "",
                   who: Callable[[int], str] = worker_name, warm: bool = False) -> int:
    """`main(*args_for(attempt))` on `nproc` local workers, started again after a failure at
    most `restarts` times (restart_policy.run_attempts, whose `label`, `restarting`, `after`
    and `flag` these are); the exit status. `args_for(attempt)`: what the workers of each
    attempt run (a restart of training resumes from a newer checkpoint). `nodes`,
    `rdzv_endpoint`, `run_id`: as `start_elastic`'s (every machine names the same run). `warm`:
    start the forkserver that restarts fork from before the first attempt, so that a restart
    does not wait for it (a replica group's rejoin: its peers step without it meanwhile)."""
    if warm and restarts:
        warm_forkserver(device, main.__module__)

    def attempt(n: int) -> tuple[int, Failure | None]:
        return launch_attempt(main, args_for(n), nproc, device, n, rdzv_endpoint=rdzv_endpoint, nodes=nodes,
                              grace_s=grace_s, run_id=run_id, who=who)

    try:
        return run_attempts(attempt, restarts, label=label, restarting=restarting, after=after, flag=flag)
    finally:
        if warm and restarts:
            stop_warm_forkserver()
