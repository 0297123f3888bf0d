"""Gradient clipping by the norm of the whole model's gradient, whatever the layout.

`torch.nn.utils.clip_grad_norm_` assumes every gradient lives on one mesh and that this rank
sees the whole model. Here a rank may hold plain tensors (replicated), DTensors on the tp
mesh, DTensors on a (dp, tp) mesh after FSDP, and only one pipeline stage's layers. Each
gradient's squared norm is summed over the mesh dimensions it is *sharded* on (never over
those it is replicated on, which would count it twice), then the stages' totals are summed
over the pp group. Expert-parallel parameters differ per ep rank (each holds its own
experts): their squares are also summed over the ep group, once. Every rank ends with the
same global norm and the same clip factor.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist


def _full_squares(grads: list) -> torch.Tensor:
    """Sum of squares of DTensor gradients that share one mesh and placements."""
    from torch.distributed.tensor import Partial

    first = grads[0]
    mesh, placements = first.device_mesh, first.placements
    local = torch.stack([g.to_local().float().pow(2).sum() for g in grads]).sum()
    for dim, placement in enumerate(placements):
        # A partial gradient must be summed before it is squared (done above).
        if isinstance(placement, Partial):
            raise RuntimeError(f"gradient with a Partial placement {placements} reached clipping")
        # Every other placement is some sharding (Shard, or FSDP's _StridedShard over a
        # tp-sharded dim, which is not a Shard subclass): the pieces add up.
        if not placement.is_replicate():
            dist.all_reduce(local, group=mesh.get_group(dim))
    return local


def _squares(grads: list, device) -> torch.Tensor:
    """Sum of squares of `grads` over all their shards: plain tensors as they are, DTensors
    grouped by mesh and placements, each group reduced over its sharded mesh dims."""
    from torch.distributed.tensor import DTensor

    total = torch.zeros((), device=device, dtype=torch.float32)
    by_layout: dict[tuple, list] = defaultdict(list)
    for grad in grads:
        if isinstance(grad, DTensor):
            by_layout[(id(grad.device_mesh), grad.placements)].append(grad)
        else:
            total += grad.float().pow(2).sum()
    # Sorted so every rank issues its collectives in the same order.
    for key in sorted(by_layout, key=lambda k: (by_layout[k][0].device_mesh.mesh_dim_names, str(k[1]))):
        total += _full_squares(by_layout[key])
    return total


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, *, pp_group=None, experts=None) -> float:
    """Scale every gradient so the global L2 norm is at most `max_norm`; return the norm.

    experts: `phalanx.parallel.expert.expert_params(model)`, i.e. (ids of the expert-parallel
    parameters, ep group), or None without expert parallelism.
    """
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    for param in parameters:
        # Replicated DTensor parameters used on sequence-sharded activations (the norms under
        # sp=true) receive partial gradients, one summand per tp rank; sum them now, so the
        # norm and the optimizer see the real gradient.
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(grad.device_mesh, param.placements)
    device = parameters[0].grad.device if parameters else torch.device("cpu")
    expert_ids, ep_group = experts if experts else (set(), None)
    total = _squares([p.grad for p in parameters if id(p) not in expert_ids], device)
    if ep_group is not None:
        mine = _squares([p.grad for p in parameters if id(p) in expert_ids], device)
        dist.all_reduce(mine, group=ep_group)  # each ep rank holds different experts
        total += mine
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)  # each stage holds different parameters
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in parameters:
        grad = param.grad
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale)
    return float(norm)
