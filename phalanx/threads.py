"""How many intra-op threads a process's torch runs, and how its idle OpenMP threads wait:
chosen from the cores this process may use, shared among the processes of this machine.
Torch-free, so that `phalanx/cli.py` can set the wait policy before torch is imported.

Why: torch's CPU kernels run on an OpenMP team. An idle member of the team spins for a while
before it sleeps (GNU libgomp, what torch's Linux wheels ship: some 300,000 spins by default;
Intel's libiomp: KMP_BLOCKTIME, 200 ms). On a machine whose cores other processes also use,
a thread of the team spins on a core that another process needs, and every barrier waits for
the member that was preempted: `phalanx serve` with two threads on a busy 2-core machine ran
about 7x slower than with one. So:

- the count: the cores in this process's affinity (`os.sched_getaffinity`, physical cores,
  hyper-threads counted once where /sys says so), less one a server keeps for its HTTP and
  detokenizing threads (`SERVER_RESERVED_CORES`), divided among this machine's ranks
  (LOCAL_WORLD_SIZE), at least 1; `--threads N` or OMP_NUM_THREADS set by the user instead;
- the wait policy: passive (OMP_WAIT_POLICY=PASSIVE, and KMP_BLOCKTIME=0 for Intel's runtime):
  an idle thread sleeps at once instead of spinning. The runtime reads it when it loads, with
  torch, so it must be in the environment before torch is imported in that process; a
  process's workers inherit it. A value the user set is kept.

Measured: benchmarks/serve_threads_busy.py (benchmarks/README.md).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import UserError

PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
"""What phalanx puts in the environment when the user set no wait policy: GNU's and LLVM's
OpenMP read OMP_WAIT_POLICY; Intel's honours KMP_BLOCKTIME (ms an idle thread spins) first."""
SYSFS_CPUS = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class ThreadChoice:
    """One process's intra-op thread count and why, for the one line said at start."""
    threads: int
    """torch.set_num_threads' argument."""
    why: str
    """Where the count came from: "--threads 3", "OMP_NUM_THREADS=2 in the environment", or
    the cores and ranks it was divided from."""
    wait_policy: str
    """OMP_WAIT_POLICY as the OpenMP runtime saw it ("PASSIVE", or the user's value)."""
    automatic: bool = False
    """The count came from the cores, not from the user (--threads, OMP_NUM_THREADS): a server
    may then change it while it runs (thread_tuner.py)."""

    def line(self, actual: int) -> str:
        """The start-up line; `actual`: torch.get_num_threads() once set."""
        if self.wait_policy == PASSIVE["OMP_WAIT_POLICY"]:
            policy = "PASSIVE (an idle thread sleeps instead of spinning on a core others may need)"
        elif self.wait_policy:
            policy = f"{self.wait_policy} (OMP_WAIT_POLICY in the environment)"
        else:
            policy = "the runtime's default (KMP_BLOCKTIME in the environment: the wait is left to the user)"
        plural = "s" if actual != 1 else ""
        return f"phalanx: {actual} intra-op thread{plural} per process ({self.why}); OpenMP wait policy {policy}"


def check_requested(threads: int | None, flag: str = "--threads") -> None:
    """A UserError unless `threads` is None, 0 (automatic) or a positive count."""
    if threads is not None and threads < 0:
        raise UserError(f"{flag} must be >= 0 (0: chosen from the cores this process may use), got {threads}")


def physical_cores(cpus: set[int], sysfs: Path = SYSFS_CPUS) -> int:
    """The cores behind the logical CPUs `cpus`: two hyper-threads of one core count once.
    Where /sys does not say (not Linux, a container hiding it), every CPU counts."""
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def affinity() -> set[int]:
    """The logical CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


SERVER_RESERVED_CORES = 1
"""Cores a server keeps out of its ranks' intra-op teams, for its own other threads: the HTTP
server, tokenizing and detokenizing, the engine loop's host work between steps. vLLM's CPU
backend does the same (vllm/utils/ompmultiprocessing.py reserves a core per local rank for
its scheduler and API processes). Measured here: on the 2-core machine `phalanx serve`'s
thread tuner moved from 2 threads to 1 in every round of benchmarks/serve_vs_vllm.py, one
thread 1.11-2.22x faster per token (benchmarks/README.md)."""


def choose_threads(*, requested: int = 0, cores: int, local_ranks: int,
                   environ: Mapping[str, str], reserved: int = 0) -> ThreadChoice:
    """The count for one of `local_ranks` processes sharing `cores`: `requested` (--threads)
    when given, else the user's OMP_NUM_THREADS, else (cores - reserved) // local_ranks (at
    least 1); `reserved`: cores kept for the process's other threads (SERVER_RESERVED_CORES)."""
    check_requested(requested)
    policy = environ.get("OMP_WAIT_POLICY", "")
    if requested:
        return ThreadChoice(requested, f"--threads {requested}", policy)
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp:
        first = omp.split(",")[0]  # OpenMP allows a list per nesting level; the first is the team's
        if first.isdigit() and int(first) > 0:
            return ThreadChoice(int(first), f"OMP_NUM_THREADS={omp} in the environment", policy)
    local_ranks = max(1, local_ranks)
    reserved = min(max(reserved, 0), cores - 1)
    count = max(1, (cores - reserved) // local_ranks)
    ranks = f"{local_ranks} local ranks" if local_ranks != 1 else "1 local rank"
    kept = f" - {reserved} kept for the server's other threads" if reserved else ""
    return ThreadChoice(count, f"{cores} cores in this process's affinity{kept} / {ranks}", policy, automatic=True)


def choose_for_this_process(requested: int = 0, environ: Mapping[str, str] = os.environ, *,
                            reserved: int = 0) -> ThreadChoice:
    """choose_threads for this process: its affinity's cores, LOCAL_WORLD_SIZE ranks (1 when
    it is not one of several workers)."""
    local_ranks = int(environ.get("LOCAL_WORLD_SIZE") or environ.get("WORLD_SIZE") or 1)
    return choose_threads(requested=requested, cores=physical_cores(affinity()), local_ranks=local_ranks,
                          environ=environ, reserved=reserved)


def set_wait_policy(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put the passive wait policy in `environ` unless the user chose one (OMP_WAIT_POLICY or
    KMP_BLOCKTIME set: all of it is left as it is); the variables added. Call before torch is
    imported: the OpenMP runtime reads them when it loads."""
    if "OMP_WAIT_POLICY" in environ or "KMP_BLOCKTIME" in environ:
        return {}
    environ.update(PASSIVE)
    return dict(PASSIVE)


PR_SET_NAME = 15  # linux/prctl.h


def name_this_thread(name: str) -> None:
    """Give the calling thread its name in the operating system (Linux; 15 bytes at most), so
    that `top -H`, `ps -L`, py-spy and /proc/PID/task/TID/comm tell it from the process's other
    threads: Python 3.11's `threading.Thread(name=...)` names it for Python only. Elsewhere,
    or where libc has no prctl, nothing happens."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
