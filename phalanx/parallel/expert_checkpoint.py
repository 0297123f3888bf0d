"""Checkpoint expert-parallel weights as the full (n_experts, ...) stacks they are.

Each ep rank holds different rows of the same parameter name. DCP takes a plain tensor (or a
DTensor over one edp mesh) with one name on many ranks to be one replicated value and saves
only one rank's copy, which would silently lose the other ranks' experts. So before saving
(and before loading), each expert entry of the model and optimizer state becomes a DTensor
sharded along dim 0 over "ep", whose global shape is the whole stack: DCP then writes every
expert once, and can load it into any other ep degree (or none) by rows.

With expert slots (`--expert-slots`) a rank holds slots, any experts in any order, some
replicated. The checkpoint still holds the (n_experts, ...) stack in expert order (one
replica of each, the replicas being identical): saving gathers the layer's slots over "ep"
and keeps each rank's block of experts; loading gathers the blocks and keeps the rows of this
rank's slots under the placement in force (the checkpoint's, restored first by the trainer).
So a checkpoint loads into any slot count, any placement and any plain layout. Cost: one
all-gather of the layer's slots per tensor per save and load, rare next to training steps.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from phalanx.model.init import canonical_name
from phalanx.parallel.expert import ShardedExperts


def _expert_modules(model) -> dict[str, ShardedExperts]:
    """Canonical parameter name -> its expert-parallel module."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, ShardedExperts):
            for weight in ("w1", "w2", "w3"):
                found[canonical_name(f"{name}.{weight}")] = module
    return found


def _gather_rows(local: torch.Tensor, group) -> torch.Tensor:
    """Every ep rank's rows, stacked in rank order (collective over `group`)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def _to_global(value: torch.Tensor, module: ShardedExperts) -> torch.Tensor:
    # Under FSDP the ep block is itself sharded over "edp": gather it first.
    local = value.full_tensor() if isinstance(value, DTensor) else value
    if module.placement is not None:  # slots -> this rank's block of experts, in expert order
        held, group = module.placement.slot_expert, module.shard.group

        per_rank, rank = module.shard.n_experts // module.placement.ep, dist.get_rank(group)
        first = range(per_rank * rank, per_rank * (rank + 1))
        local = _gather_rows(local.detach(), group)[[held.index(expert) for expert in first]]
    return DTensor.from_local(local, module.shard.mesh, [Shard(0)], run_check=False)


def _to_local_like(loaded: torch.Tensor, original: torch.Tensor, module: ShardedExperts) -> torch.Tensor:
    block = loaded.to_local()  # (n_local, ...) this ep rank's experts
    if module.placement is not None:  # experts in order -> the experts of this rank's slots
        block = _gather_rows(block, module.shard.group)[module.shard.expert_rows()]
    if not isinstance(original, DTensor):
        return block
    # FSDP: keep this edp rank's chunk of the block, the way FSDP shards it: torch.chunk along
    # its shard dim (0, or with expert slots 1 or 2 inside each slot, evenly), whose fewer
    # chunks on dim 0 (fewer local experts than edp ranks) FSDP pads with empty ones.
    mesh = original.device_mesh
    dim = next(p.dim for p in original.placements if p.is_shard())
    chunks = block.chunk(mesh.size(), dim=dim)
    rank = mesh.get_local_rank()
    chunk = chunks[rank] if rank < len(chunks) else block[:0]  # (0, ...) on a rank FSDP left empty
    return DTensor.from_local(chunk, mesh, original.placements, shape=original.shape, stride=original.stride())


def globalize_experts(model, state: dict) -> tuple[dict, Callable[[], dict]]:
    """A copy of {"model": ..., "optim": ...} whose expert entries are full-stack DTensors.

    Containers are copied, never changed in place: the optimizer's state dict shares its
    per-parameter dicts with the live optimizer. Also returns `restore()`, which gives that
    copy back with this rank's own form of each entry (call it after `dcp.load` filled the
    DTensors, before `set_state_dict`). Without expert parallelism `state` is returned as is.
    """
    modules = _expert_modules(model)
    if not modules:
        return state, lambda: state
    optim_entries = dict(state["optim"].get("state", {}))
    out = {"model": dict(state["model"]), "optim": {**state["optim"], "state": optim_entries}}
    swapped: list[tuple[dict, str, torch.Tensor, ShardedExperts]] = []

    def swap(container: dict, key: str, module) -> None:
        swapped.append((container, key, container[key], module))
        container[key] = _to_global(container[key], module)

    # Sorted: every rank must gather (FSDP) in the same order.
    for name in sorted(modules):
        if name in out["model"]:
            swap(out["model"], name, modules[name])
        if name in optim_entries:
            optim_entries[name] = dict(optim_entries[name])
            for key, value in sorted(optim_entries[name].items()):
                if torch.is_tensor(value) and value.dim() > 0:  # exp_avg, exp_avg_sq; not "step"
                    swap(optim_entries[name], key, modules[name])

    def restore() -> dict:
        for container, key, original, module in swapped:
            container[key] = _to_local_like(container[key], original, module)
        return out

    return out, restore
