"""Gradient clipping by the norm over the whole model, wherever its gradients live.

torch's `clip_grad_norm_` needs every gradient on one mesh (it stacks per-tensor norms) and
only sees what this rank holds. Under expert parallelism neither holds: FSDP shards experts
over "edp" and the rest over "dp" (two meshes), and each ep rank holds different experts, so
the local norm misses the other ranks' experts and ranks would clip by different factors.
Here: one norm per mesh (DTensor norms reduce over their own mesh), expert norms summed over
"ep", then every gradient is scaled by the same factor on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Squared 2-norm of `grads` over all of their shards (per mesh, then added)."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
    total = torch.zeros((), dtype=torch.float32)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        total = total + norm.float().cpu() ** 2
    return total


def clip_grad_norm_(model: nn.Module, max_norm: float) -> float:
    """Scale all gradients so their global 2-norm is at most max_norm; return that norm."""
    expert_grads, ep_group = [], None
    expert_ids = set()
    for module in model.modules():
        if getattr(module, "expert_shard", None) is not None:
            ep_group = module.ep_group
            for param in module.parameters(recurse=False):
                expert_ids.add(id(param))
                if param.grad is not None:
                    expert_grads.append(param.grad)
    params = [p for p in model.parameters() if p.grad is not None]
    squares = _sum_of_squares([p.grad for p in params if id(p) not in expert_ids])
    if ep_group is not None:
        experts = _sum_of_squares(expert_grads)
        device_copy = experts.to(next(model.parameters()).device)  # NCCL reduces device tensors
        dist.all_reduce(device_copy, group=ep_group)  # each ep rank holds different experts
        squares = squares + device_copy.cpu()
    total = float(squares.sqrt())
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for param in params:
            param.grad.mul_(scale)
    return total
