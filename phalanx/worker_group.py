"""The worker processes of every multi-process command (`phalanx train`, `serve`, `generate`,
`match`, `blur`): starting them through PyTorch's elastic launcher (the machinery of
`torchrun`), and, in each worker, joining and leaving the process group. The launcher of
`train`, `serve` and `generate`, with its one restart policy, is phalanx/launch/worker_launch.py."""

from __future__ import annotations

import datetime
import functools
import logging
import multiprocessing
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from phalanx.errors import UserError
from phalanx.forked_forkserver import fork_forkserver, stop_forked_forkserver
from phalanx.ports import free_port
from phalanx.process_count import check_process_count, usable_cores
from phalanx.restart_timeline import mark
from phalanx.threads import choose_for_this_process

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""For commands without --collective-timeout (generate, match, blur)."""


def check_nproc(nproc: int, device: str) -> None:
    """A command's --nproc against the process bound, and the GPUs or CPU cores this machine has."""
    check_process_count(nproc)
    if device != "cpu" and torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if nproc > gpus:
            raise UserError(f"--nproc {nproc} asks for more GPUs than this machine has ({gpus})")
    elif nproc > usable_cores():
        print(f"phalanx: warning: {nproc} processes on {usable_cores()} CPU cores; they will share cores "
              "(fine for testing layouts, slow for training)", file=sys.stderr)


def use_threads(requested: int = 0, reserved: int = 0) -> int:
    """Set this process's torch intra-op threads as phalanx/threads.py chooses (`requested`:
    --threads, 0 = automatic; `reserved`: cores a server keeps for its other threads). The
    previous count, for a caller that runs in someone else's process (a test) to put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(choose_for_this_process(requested, reserved=reserved).threads)
    return before


def say_threads(requested: int = 0, reserved: int = 0) -> None:
    """Rank 0 prints the one line of the threads chosen and why (after use_threads). A command
    says it once its work has started, after the checks whose errors are one line each."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(choose_for_this_process(requested, reserved=reserved).line(torch.get_num_threads()), file=sys.stderr,
              flush=True)


def init_worker_group(device: str, timeout: datetime.timedelta = PROCESS_GROUP_TIMEOUT) -> None:
    """Join the process group of a launched worker (nothing in a single process). On CUDA the
    group also has a gloo backend for CPU tensors, which asynchronous checkpointing needs."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        use_cuda = device != "cpu" and torch.cuda.is_available()
        dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", timeout=timeout,
                                store=_attempt_store(world_size, timeout),
                                rank=int(os.environ["RANK"]), world_size=world_size)


def bound_every_group(timeout_s: float) -> None:
    """Give every process group this process belongs to the timeout `timeout_s`.

    The groups a DeviceMesh makes take torch's 30-minute default whatever the default group's
    timeout (torch 2.13: a dp=2,tp=2 mesh's groups said 0:30:00 under a 1-minute default
    group), and a caller's own group (a test's, a user's) may have any; without this a rank
    stuck in a tp or pipeline exchange would hold the others for half an hour. Uses two private
    names of torch.distributed that have been there since torch 2.2 (`_set_pg_timeout`, the
    `_world.pg_map` of this process's groups); where they are missing the groups keep theirs."""
    if not dist.is_initialized() or not hasattr(c10d, "_set_pg_timeout") or not hasattr(c10d, "_world"):
        return
    for group in list(c10d._world.pg_map):
        try:
            c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)
        except (ValueError, AssertionError, RuntimeError):
            pass  # not a member, or a backend that takes no timeout: it keeps its own


def _attempt_store(world_size: int, timeout: datetime.timedelta = PROCESS_GROUP_TIMEOUT):
    """Under a torchrun restart, the agent's store (it outlives the workers) still holds the
    failed attempt's process-group keys, among them the dead ranks' gloo addresses: a
    restarted rank read one and was refused. A prefix per attempt keeps them apart. None (the
    default env:// rendezvous) otherwise."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"phalanx/attempt_{attempt}", store)


def run_in_group(device: str, body, on_user_error=None, timeout: datetime.timedelta = PROCESS_GROUP_TIMEOUT,
                 *, threads: int = 0, reserved: int = 0, say: bool = True):
    """`body()` on this worker with its process group up, and torn down after; torch on the
    intra-op threads `use_threads(threads, reserved)` chooses for the worker's share of the
    cores (the count it had is put back after), said at once unless `say` is False (the body
    then says it, `say_threads`). A UserError is printed once (by rank 0; also passed to
    `on_user_error`) and gives None, for the caller's exit status 2."""
    rank = int(os.environ.get("RANK", "0"))
    threads_before = use_threads(threads, reserved)
    if say:
        say_threads(threads, reserved)
    init_worker_group(device, timeout)
    mark("process_group_up")
    try:
        return body()
    except UserError as error:
        if rank == 0:
            print(f"phalanx: error: {error}", file=sys.stderr)
            if on_user_error:
                on_user_error(str(error))
        return None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads_before)


def start_elastic(entry, args: tuple, nproc: int, device: str, rdzv_endpoint: str = "",
                  nodes: tuple[int, int] = (1, 1), *, quiet: bool = False, grace_s: int = 30, run_id: str = "",
                  fresh: bool = False, preload: str = "phalanx.launch.worker_launch") -> dict:
    """Run entry(*args) on `nproc` local workers through PyTorch's elastic launcher (RANK,
    WORLD_SIZE, LOCAL_RANK set in each); returns {rank: return value}. Shared with
    `phalanx match` and `phalanx blur`; failures raise the launcher's own exceptions. `nodes`:
    (min, max) machines, each running this with the same `rdzv_endpoint` (nproc per machine);
    `run_id` must then be the same on every machine. `quiet`:
    not even the agent's error lines (the caller reports); `grace_s`: how long the agent waits
    for workers it signals (SIGTERM, SIGINT) before it kills them; `fresh`: on CPU, fork the
    workers from a clean server process instead of this one (see the start method below), one
    that imported the module `preload` (the workers' code: each worker then starts without
    importing it)."""
    # The agent's loggers each carry their own level; quiet them all, errors still show.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL if quiet else logging.ERROR)
    # torch.multiprocessing says when it terminates the workers left after one failed.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR if quiet else logging.NOTSET)
    # Forking reuses this process's imported torch (seconds saved per worker); CUDA must not be
    # initialized before a fork, so GPU runs spawn fresh interpreters instead. A fork also copies
    # locks that other threads of this process hold (the rendezvous store's thread resolving an
    # address holds glibc's resolver lock): seen to hang a restarted worker for good. So `fresh`
    # launches fork from a forkserver: a single-threaded process that imports phalanx once.
    start_method = "fork"
    if torch.cuda.is_available() and device != "cpu":
        start_method = "spawn"
    elif fresh or nodes[1] > 1:
        # Several machines: another machine's workers may connect to this machine's store
        # while it forks (the barrier below only orders this machine's own workers).
        multiprocessing.get_context("forkserver").set_forkserver_preload([preload])
        start_method = "forkserver"
    if start_method == "fork":
        # A first launch still forks from this process (a forkserver costs a torch import, some
        # 5 s a launch on 2 busy cores). There the store's thread resolves the address of each
        # worker that connects, so the workers wait until the last one is forked before any
        # connects: one that did not left two of four workers hung for good.
        entry = AfterSiblingsForked(entry, nproc)
    # One machine: torchrun's own default, the static rendezvous (the agent's store on a port of
    # this machine), not c10d's, which first waits a random 0 to 0.3 s to spread the agents of
    # many machines over its store (torch 2.13's DynamicRendezvousHandler.next_rendezvous): a
    # replica group's restart waited that too while its peers stepped without it.
    alone = nodes == (1, 1) and not rdzv_endpoint
    config = LaunchConfig(
        min_nodes=nodes[0], max_nodes=nodes[1], nproc_per_node=nproc, run_id=run_id or f"phalanx-{os.getpid()}",
        rdzv_backend="static" if alone else "c10d", rdzv_endpoint=rdzv_endpoint or f"127.0.0.1:{free_port()}",
        rdzv_configs={"rank": 0} if alone else {},
        local_addr="127.0.0.1" if not rdzv_endpoint else None, max_restarts=0, monitor_interval=0.1,
        shutdown_timeout=grace_s,
        start_method=start_method,
    )
    # The agent installs handlers that turn SIGTERM/SIGINT into exceptions and never restores
    # them; put back the caller's, so a later fork (a prepare pool, a test) is not left with them.
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return elastic_launch(config, entry)(*args)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def warm_forkserver(device: str, preload: str) -> None:
    """Start now the forkserver that a restart (`start_elastic(..., fresh=True)`) forks its
    workers from, with `preload` imported, instead of at the restart: its interpreter start and
    torch import (seconds on busy cores) are then off the restart's path. Where this process is
    still one thread, the server is a fork of it, which has all of that imported already
    (phalanx/forked_forkserver.py); else a new interpreter that imports it (no fork of this
    process's threads). Once per process; nothing on GPUs, whose workers are spawned. A caller
    ends it with `stop_warm_forkserver` before it exits."""
    if torch.cuda.is_available() and device != "cpu":
        return
    # Imported when asked for, not at the top: the forkserver's own module, used only here.
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload([preload])
    if not fork_forkserver(preload):
        forkserver.ensure_running()


def stop_warm_forkserver() -> None:
    """End a forkserver that `warm_forkserver` forked (one started as a new interpreter holds
    none of this process's files and ends by itself after this process)."""
    stop_forked_forkserver()


class AfterSiblingsForked:
    """`entry`, run in a forked worker only once all `nproc` workers of this machine are forked.

    The launcher is not single-threaded when the elastic agent forks the workers: the store's
    server thread resolves the address of each worker that connects (glibc's getnameinfo, under
    the resolver's lock). A fork taken in that moment copies the lock held, with no thread left
    to release it, and the child's own first connection waits on it forever, in
    `init_process_group`, a state no timeout ends. Here every worker waits at a barrier that
    the last one forked opens, so no worker connects, and the store's thread stays idle, while
    forks are still taken (the agent starts no other threads that resolve addresses). A
    multi-machine launch, where another machine's workers may connect to this machine's store
    while it forks, uses a forkserver instead (single-threaded: no lock held at a fork)."""
    BARRIER_TIMEOUT_S = 60.0
    """A sibling that never arrives (its fork failed; the agent then stops the rest) lets the
    others go on after this, to fail the way they would have."""
    def __init__(self, entry, nproc: int):
        self.entry = entry
        self.barrier = multiprocessing.get_context("fork").Barrier(nproc)
        functools.update_wrapper(self, entry)

    def __call__(self, *args):
        try:
            self.barrier.wait(self.BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            pass
        return self.entry(*args)
