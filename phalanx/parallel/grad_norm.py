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
from torch.distributed.tensor import DTensor, Partial


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared elements of plain tensors, one fused kernel per dtype and device."""
    norms = torch._foreach_norm(tensors, 2.0)
    return torch.stack([n.float() for n in norms]).pow(2).sum()


def _full_squares(grads: list) -> torch.Tensor:
    """Sum of squares of DTensor gradients that share one mesh and placements."""
    first = grads[0]
    mesh, placements = first.device_mesh, first.placements
    local = _sum_of_squares([g.to_local() for g in grads])
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
    total = torch.zeros((), device=device, dtype=torch.float32)
    # Gradients on the same ranks with the same placements share their collectives. (FSDP
    # builds a mesh object per parameter, so meshes are compared by names and ranks, not id.)
    by_layout: dict[tuple, list] = defaultdict(list)
    plain: list[torch.Tensor] = []
    for grad in grads:
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            by_layout[(mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist()), str(grad.placements))].append(grad)
        else:
            plain.append(grad)
    if plain:
        total += _sum_of_squares(plain)
    for key in sorted(by_layout):  # the same order on every rank of a group
        total += _full_squares(by_layout[key])
    return total


def _slots_counted(grad, mask: torch.Tensor):
    """The slots of an expert slot gradient that the norm counts (dim 0 rows under `mask`).
    Under FSDP the gradient is sharded over edp inside each slot: mask the local slice and keep
    it a DTensor on the same mesh, so its squares are still summed over edp."""
    if not isinstance(grad, DTensor):
        return grad[mask]
    return DTensor.from_local(grad.to_local()[mask], grad.device_mesh, grad.placements, run_check=False)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, *, pp_group=None, experts=None) -> float:
    """Scale every gradient so the global L2 norm is at most `max_norm`; return the norm.

    experts: `phalanx.parallel.expert.expert_params(model)`, i.e. (ids of the expert-parallel
    parameters, ep group[, {id: mask of the slots to count}]), or None without expert parallelism.
    """
    parameters = [p for p in parameters if p.grad is not None]
    for param in parameters:
        # Replicated DTensor parameters used on sequence-sharded activations (the norms under
        # sp=true) receive partial gradients, one summand per tp rank; sum them now, so the
        # norm and the optimizer see the real gradient.
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(grad.device_mesh, param.placements)
    device = parameters[0].grad.device if parameters else torch.device("cpu")
    expert_ids, ep_group, *masks = experts if experts else (set(), None)
    once = masks[0] if masks else {}  # expert slots: each expert's first replica only
    total = _squares([p.grad for p in parameters if id(p) not in expert_ids], device)
    if ep_group is not None:
        mine = _squares([_slots_counted(p.grad, once[id(p)]) if id(p) in once else p.grad
                         for p in parameters if id(p) in expert_ids], device)
        dist.all_reduce(mine, group=ep_group)  # each ep rank holds different experts
        total += mine
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)  # each stage holds different parameters
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    local_grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters]
    if local_grads:
        torch._foreach_mul_(local_grads, scale)
    return float(norm)
