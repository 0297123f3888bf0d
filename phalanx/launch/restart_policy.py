"""The one restart policy of every launcher of worker processes: `phalanx train --nproc N`,
`phalanx serve --nproc N`, each replica group of `phalanx train --replica-groups R`, and
`phalanx generate --nproc N` (which has no restarts: the same lines, none left).

A launch is a loop of attempts, each one elastic launch of all the workers
(phalanx/launch/worker_launch.py), rather than the elastic agent's own `max_restarts`: the agent
restarts every failure, a user error (exit status 2) too, and keeps the failure to itself, so
the workers could not be told why they were restarted, nor the user get one clean line. Here
each attempt ends with (status, failure):

- a failure of a worker (a signal such as SIGKILL from the OOM killer, a crash, a hang ended by
  the collective timeout) starts the next attempt while restarts are left, with the restart's
  number and reason in the workers' environment (`RESTART_ENV`, `REASON_ENV`), and one line
  `phalanx: <why>; restarting from <where> (restart i of n)`; with none left, one line saying
  so and status 1;
- a user error (status 2, printed by rank 0), a stop by SIGTERM/SIGINT (`STOP_STATUS`) or a
  success ends the loop with that status.

Torch-free: the command line reads the restart's number before importing torch.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Callable

RESTART_ENV = "PHALANX_RESTART_COUNT"
REASON_ENV = "PHALANX_RESTART_REASON"

DEFAULT_MAX_RESTARTS = 3
"""With several worker processes; one process run in the launcher's own has none (nothing
would be left to restart it)."""

STOP_STATUS = {signal.SIGTERM: 143, signal.SIGINT: 130}
"""A worker's exit status after a stop by this signal (the shell's 128 + signal number)."""

CONDITIONS = ("CollectiveTimeout:",)
"""Worker exceptions that describe the cluster's state, not a fault in the code: their one
line says all (no traceback)."""


@dataclass
class Failure:
    """A worker that failed: why, in one line, and its traceback when it raised."""
    reason: str
    traceback: str = ""


def max_restarts(configured: int | None, nproc: int) -> int:
    """--max-restarts, or its default (not given: None, or -1 for `phalanx train`'s config):
    DEFAULT_MAX_RESTARTS with several workers, else 0."""
    if configured is not None and configured >= 0:
        return configured
    return DEFAULT_MAX_RESTARTS if nproc > 1 else 0


def restart_count() -> int:
    """In a worker: 0 for a first attempt, N for the N-th restart (this policy's, or a user's
    own `torchrun --max-restarts`, whose workers see TORCHELASTIC_RESTART_COUNT)."""
    return int(os.environ.get(RESTART_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def restart_reason() -> str:
    return os.environ.get(REASON_ENV) or "torchrun restarted the workers after a failure"


def run_attempts(attempt: Callable[[int], tuple[int, Failure | None]], restarts: int, *, label: str = "",
                 restarting: Callable[[], str] = lambda: "restarting", after: Callable[[], str] = lambda: "",
                 flag: str | None = "--max-restarts") -> int:
    """`attempt(n)` for n = 0, 1, ... until one ends without a failure, or `restarts` restarts
    are spent; the exit status. `label`: what the workers are, before each line ("replica
    group 1: "); `restarting()`: what a restart does, said at each (`restarting from step 40`);
    `after()`: what the user can do once the restarts are spent; `flag`: the option that sets
    `restarts` (None: the command has none, and its one failure is said plainly)."""
    saved = {name: os.environ.get(name) for name in (RESTART_ENV, REASON_ENV)}
    try:
        for n in range(restarts + 1):
            status, failure = attempt(n)
            if failure is None:
                return status
            if failure.traceback:
                print(failure.traceback.rstrip(), file=sys.stderr)
            if n == restarts:
                words = [f"phalanx: {label}{failure.reason}"]
                if flag is not None:
                    words.append(f"no restarts left ({flag} {restarts})" if restarts else f"not restarted ({flag} 0)")
                if hint := after():
                    words.append(hint)
                print("; ".join(words), file=sys.stderr, flush=True)
                return 1
            print(f"phalanx: {label}{failure.reason}; {restarting()} (restart {n + 1} of {restarts})",
                  file=sys.stderr, flush=True)
            os.environ[RESTART_ENV], os.environ[REASON_ENV] = str(n + 1), failure.reason
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 1
