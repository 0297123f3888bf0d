"""Run a function on N gloo ranks forked from this process (tests and benchmarks).

Forking reuses the parent's imported torch, so a multi-rank test does not pay a `torchrun`
launch that starts an interpreter and imports torch once per rank. The process-group timeout is short so
a collective mismatch fails the test in seconds instead of hanging it.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing
import os
import pickle
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

from phalanx.ports import free_port

RANK_LAZY_IMPORTS = ("torch._dynamo", "torch.distributed.pipelining", "torch.utils.tensorboard", "matplotlib.pyplot",
                     "matplotlib.backends.backend_agg")
"""Modules a training rank imports on first use (torch._dynamo through the optimizer and DCP,
the pipeline schedules, the TensorBoard log, rank 0's loss plot): several seconds of CPU per
rank per launch on a shared 2-core machine, paid once in the parent by `preload_rank_imports`."""


def preload_rank_imports() -> None:
    """Import RANK_LAZY_IMPORTS here, so that ranks forked from this process (run_ranks, and
    an in-process `phalanx train --nproc N`) inherit them instead of each importing them."""
    # Imported when run, not at the top: it brings in matplotlib, which start-up need not wait for.
    import matplotlib

    matplotlib.use("Agg")  # what the loss plot selects; no display is opened
    for name in RANK_LAZY_IMPORTS:
        importlib.import_module(name)
    # Imported when run, not at the top: it brings in numpy, which start-up need not wait for.
    from phalanx.data.corpus import stdlib_corpus

    stdlib_corpus()  # the default training data, read once here instead of once per rank and run


def _child(rank: int, world_size: int, port: int, timeout_s: float, fn, args, conn) -> None:
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # ranks share the cores; more threads per rank only contend
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        result = fn(*args)
        message = ("ok", result)
    except BaseException:  # report everything, including SystemExit, to the parent
        message = ("error", traceback.format_exc())
    try:
        # Plain pickle copies tensors into the message; multiprocessing's own pickler would
        # share their memory through this process, which is about to exit.
        conn.send_bytes(pickle.dumps(message))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
              preload: bool = True) -> list[Any]:
    """Call fn(*args) on `world_size` forked ranks; return each rank's result, rank order.

    fn runs with the default process group initialized (gloo) and RANK/WORLD_SIZE set. A rank
    that raises makes this raise with that rank's traceback; a hang past `timeout_s` kills all.
    preload=False skips `preload_rank_imports`: for callers that train nothing and may run in
    an environment without the trainer's dependencies (benchmarks/moe_vs_deepspeed.py runs in
    DeepSpeed's own venv, which has torch and DeepSpeed only).
    """
    if preload:
        preload_rank_imports()
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    pipes, procs = [], []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(rank, world_size, port, min(timeout_s, 60.0), fn, args, child_end))
        proc.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(proc)
    results: list[Any] = [None] * world_size
    errors: list[str] = []
    waiting = dict(enumerate(pipes))
    deadline = time.monotonic() + timeout_s
    try:
        while waiting:
            remaining = deadline - time.monotonic()
            # Once one rank failed, the others are probably stuck in a collective: give them a
            # moment to report their own error, then stop waiting.
            ready = wait(list(waiting.values()), timeout=min(remaining, 2.0) if errors else max(remaining, 0.0))
            if not ready:
                if not errors:
                    errors.append(f"ranks {sorted(waiting)}: no result within {timeout_s:.0f} s")
                break
            for rank in [r for r, pipe in waiting.items() if pipe in ready]:
                try:
                    status, payload = pickle.loads(waiting.pop(rank).recv_bytes())
                except EOFError:
                    procs[rank].join(5)
                    errors.append(f"rank {rank}: died without a result (exit code {procs[rank].exitcode})")
                    continue
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append(f"rank {rank} raised:\n{payload}")
    finally:
        for proc in procs:
            proc.join(5 if not errors else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return results
