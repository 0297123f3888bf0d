"""Timing and process plumbing of the measurements: repeat-and-keep-the-best timers, gloo
worker groups that are restarted once if one hangs, and the collective and busy-machine
workers whose figures `fit.py` turns into link and share numbers."""

from __future__ import annotations

import datetime
import os
import queue as queue_module
import statistics
import time

from phalanx.errors import UserError
from phalanx.ports import free_port

SMOKE_ENV = "PHALANX_CALIBRATE_SMOKE"
"""Test hook: set to 1, every measurement runs its code path with the fewest timings (one
timed repeat after the warm-ups, one round where a figure keeps the best of two), so a test
of the whole calibration takes seconds, not minutes. The file is complete, its figures noisy."""


def smoke() -> bool:
    return os.environ.get(SMOKE_ENV) == "1"


def timeit(fn, *, repeats: int, warmup: int = 1, best: bool = False) -> float:
    """Median (or, for what the hardware can do on a shared machine, fastest) seconds of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) if best else statistics.median(times)


def sync_device(device):
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def init_worker(rank: int, world: int, port: int, threads: int, backend: str = "gloo"):
    """A measurement worker's start: its thread count, the environment the trainer's code
    reads (RANK, WORLD_SIZE, ...), a process group with a short timeout. Returns torch, dist."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    return torch, dist


def run_workers(worker, world: int, args: tuple, *, start_method: str, timeout_s: float, what: str,
                 attempts: int = 2) -> dict:
    """Run worker(rank, world, port, *args, queue) on `world` processes; return what rank 0 puts.

    A group that hangs or loses a worker is killed and started again on a fresh port (once by
    default): one 4-process gloo group in some twenty calibrations never reported, and a
    whole calibration should not be lost to that."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method)
    problem = ""
    for _ in range(attempts):
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        result, deadline = None, time.monotonic() + timeout_s
        while result is None and time.monotonic() < deadline:
            try:
                result = queue.get(timeout=1.0)
            except queue_module.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a worker died: the others would wait for it until the deadline
        crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        if result is not None:
            return result
        problem = f"a worker exited with status {crashed[0]}" if crashed else f"it did not finish in {timeout_s:.0f} s"
    raise UserError(f"{what} failed {attempts} times: {problem}")


def two_process(worker, *, quick: bool, what: str, timeout_s: float = 120.0) -> dict:
    threads = max(1, (os.cpu_count() or 1) // 2)
    repeats = 1 if smoke() else 3 if quick else 10
    return run_workers(worker, 2, (repeats, threads), start_method="fork", timeout_s=timeout_s,
                        what=f"{what} measurement on 2 gloo processes")


def collective_worker(rank: int, world: int, port: int, backend: str, sizes: list[int], repeats: int,
                       threads: int, queue) -> None:
    torch, dist = init_worker(rank, world, port, threads, backend)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    results = {}
    for op in ("all_reduce", "all_gather"):
        for nbytes in sizes:
            numel = max(1, nbytes // 4)
            x = torch.ones(numel, device=device)
            outs = [torch.empty_like(x) for _ in range(world)]
            times = []
            for i in range(repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(x)
                else:
                    dist.all_gather(outs, x)
                sync_device(device)
                if i:
                    times.append(time.perf_counter() - start)
            # The fastest repeat: a woken gloo thread sometimes waits a scheduler slice (ms) for
            # a core, which the DDP and pipeline measurements charge where it happens.
            results[f"{op}:{numel * 4}"] = min(times)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def measure_collectives(world: int, backend: str, *, quick: bool, timeout_s: float = 120.0) -> dict[str, float]:
    """Seconds per (op, bytes) on `world` processes, measured by rank 0."""
    sizes = [4096, 1 << 16, 1 << 20] if quick else [4096, 1 << 16, 1 << 20, 1 << 22, 1 << 24]
    repeats = 1 if smoke() else 3 if quick else 10
    threads = max(1, (os.cpu_count() or 1) // world)
    return run_workers(collective_worker, world, (backend, sizes, repeats, threads),
                        start_method="fork" if backend == "gloo" else "spawn", timeout_s=timeout_s,
                        what=f"collective measurement on {world} processes ({backend})")


def busy_worker(seconds: float, start, queue) -> None:
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    torch.matmul(a, b)
    start.wait()
    count, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        torch.matmul(a, b)
        count += 1
    queue.put(count * 2 * 256**3 / (time.perf_counter() - began))


def measure_delivered_share(cores: int, single_flops: float, *, quick: bool) -> float:
    """Share of `cores` x single-thread throughput this machine delivers to `cores` concurrent
    single-threaded workers, averaged over time rather than at its best moments (the other
    measurements keep their fastest repeat; on a machine shared with other jobs the job gets
    only what those jobs leave)."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    queue, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=busy_worker, args=(0.5 if quick else 2.0, start, queue)) for _ in range(cores)]
    for p in procs:
        p.start()
    start.set()
    total = sum(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=10)
    return max(0.05, min(1.0, total / (cores * single_flops)))
