"""How many local processes a command may start (`--nproc`, `prepare --workers`): the bound
of every such count, in one place. Torch-free."""

from __future__ import annotations

import os

from phalanx.errors import UserError

PROCESSES_PER_CORE = 16
"""Layouts are tested with more processes than cores (8 ranks on 2 cores); far more only
time-slice the cores while each process holds its own memory, so a larger count is a typo."""
MIN_PROCESS_LIMIT = 64


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def process_limit() -> int:
    return max(MIN_PROCESS_LIMIT, PROCESSES_PER_CORE * usable_cores())


def check_process_count(count: int, flag: str = "--nproc") -> None:
    """A UserError unless 1 <= count <= process_limit()."""
    if count < 1:
        raise UserError(f"{flag} {count} must be at least 1")
    if count > process_limit():
        raise UserError(f"{flag} {count}: at most {process_limit()} local processes on this machine "
                        f"({PROCESSES_PER_CORE} per CPU core, {usable_cores()} cores): more only share the cores, "
                        "each with its own memory")
