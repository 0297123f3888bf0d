"""Gradient clipping by the norm over the whole model, wherever its gradients live.

torch's `clip_grad_norm_` needs every gradient on one mesh (it stacks per-tensor norms) and
only sees what this rank holds. Under expert parallelism neither holds: FSDP shards experts
over "edp" and the rest over "dp" (two meshes), and each ep rank holds different experts, so
the local norm misses the other ranks' experts and ranks would clip by different factors.
Here: one norm per mesh (DTensor norms reduce over their own mesh), the experts' squares
summed over "ep", then every gradient is scaled by the same factor on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, *, experts=None) -> float:
    """Scale all gradients so their global 2-norm is at most max_norm; return that norm.

    experts: `phalanx.parallel.expert.expert_params(model)`, (ids of the expert-parallel
    parameters, ep group), or None without expert parallelism.
    """
    params = [p for p in parameters if p.grad is not None]
    expert_ids, ep_group = experts if experts else (set(), None)
    squares = _sum_of_squares([p.grad for p in params if id(p) not in expert_ids])
    if ep_group is not None:
        mine = _sum_of_squares([p.grad for p in params if id(p) in expert_ids])
        mine = mine.to(params[0].grad.device if params else "cpu")  # NCCL reduces device tensors
        dist.all_reduce(mine, group=ep_group)  # each ep rank holds different experts
        squares = squares + mine.cpu()
    total = float(squares.sqrt())
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for param in params:
            param.grad.mul_(scale)
    return total
