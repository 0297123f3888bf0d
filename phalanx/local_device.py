"""The device this process computes on: `--device auto|cpu|cuda` for train, generate and serve."""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.errors import UserError


def pick_device(name: str) -> torch.device:
    """cpu, or this process's GPU (its node-local rank's) for cuda and for auto where CUDA is there."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but torch sees no CUDA device")
    local_rank = dist.get_node_local_rank(fallback_rank=0) if dist.is_initialized() else 0
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
