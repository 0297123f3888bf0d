"""Running one piece of work per process: rank r of N computes its share and returns it.

`--nproc 1` runs in this process. `--nproc N` starts N local workers through PyTorch's elastic
launcher, as `phalanx train` does (`phalanx.worker_group.start_elastic`); each finds its share from
RANK and WORLD_SIZE and hands its result back through the launcher's return values, so the
workers need no process group (they never talk to each other, only to the parent).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from phalanx.errors import UserError
from phalanx.process_count import check_process_count
from phalanx.worker_group import start_elastic


def worker_device(device: str) -> torch.device:
    """This worker's device: cuda:(LOCAL_RANK mod GPUs), or the CPU."""
    if device == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def check_device(device: str, nproc: int) -> None:
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r}: choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: this machine has no usable CUDA device")

    check_process_count(nproc)


def _one_thread_on_cpu(work: Callable, rank: int, world_size: int, payload: Any, device: str) -> Any:
    """work(...) with one torch thread per CPU rank, the caller's setting restored after: the
    ranks (--nproc) are the parallelism. These kernels are many short ops, and splitting each
    over threads stalled whenever another process held a core: on the shared 2-core machine two
    threads ran the matcher 2x to 10x and the blur 4x slower than one (docs/kernels.md)."""
    if device != "cpu":
        return work(rank, world_size, payload)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return work(rank, world_size, payload)
    finally:
        torch.set_num_threads(before)


def _entry(work: Callable, payload: Any, device: str) -> Any:
    return _one_thread_on_cpu(work, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), payload, device)


def run_sharded(work: Callable[[int, int, Any], Any], payload: Any, nproc: int, device: str) -> list[Any]:
    """[work(rank, nproc, payload) for each rank], each rank in its own process when nproc > 1.
    `work` must be a module-level function (GPU runs spawn workers, which import it by name)."""
    check_device(device, nproc)
    if nproc == 1:
        return [_one_thread_on_cpu(work, 0, 1, payload, device)]

    try:
        results = start_elastic(_entry, (work, payload, device), nproc, device)
    except ChildFailedError as error:
        print(f"phalanx: a worker failed: {error.get_first_failure()[1].message}", file=sys.stderr)
        raise
    return [results[rank] for rank in range(nproc)]
