"""Materialize this rank's part of a parallelized meta model (step 7 of `apply`).

Each parameter's full value comes from a `WeightSource` (the seed or a checkpoint) restricted
to the rows this rank keeps: for a DTensor (tp, FSDP) the rows its placements give this
rank, for an expert stack under ep (`ShardedExperts`) this rank's block of experts, offset
into the full (n_experts, ...) stack, and both at once for experts sharded over "edp" by FSDP.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from phalanx.model.config import ModelConfig
from phalanx.model.init import RandomWeights, WeightSource, fill_weights
from phalanx.parallel.expert import ShardedExperts


def local_index(param: torch.Tensor) -> list[torch.Tensor | None]:
    """Per dim, which global rows of `param` this rank stores (None: all of them).

    For a DTensor, each dim's row numbers are distributed with the placements that shard that
    dim (others replicated), exactly as `distribute_tensor` would split the full value,
    uneven and nested (tp then fsdp) shards included; `src_data_rank=None` splits locally,
    with no communication."""
    def on_dim0(placement, dim: int):  # the same split of `dim`, on a 1-D tensor of row numbers
        # (FSDP over a tp-sharded dim is a _StridedShard, which is not a Shard in every torch)
        if isinstance(placement, _StridedShard) and placement.dim == dim:
            return _StridedShard(0, split_factor=placement.split_factor)
        return Shard(0) if placement.is_shard(dim) else Replicate()

    if not isinstance(param, DTensor):
        return [None] * param.ndim
    index: list[torch.Tensor | None] = []
    for dim, size in enumerate(param.shape):
        placements = [on_dim0(p, dim) for p in param.placements]
        if all(isinstance(p, Replicate) for p in placements):
            index.append(None)
            continue
        rows = torch.arange(size, device=param.device_mesh.device_type)
        index.append(distribute_tensor(rows, param.device_mesh, placements, src_data_rank=None).to_local().cpu())
    return index


def _locate_in(model: nn.Module):
    """The `Locate` of `model`'s layout: DTensor shards and expert blocks."""
    shards = {name: module.shard for name, module in model.named_modules() if isinstance(module, ShardedExperts)}

    def locate(name: str, param: torch.Tensor):
        index, shape = local_index(param), param.shape
        shard = shards.get(name.rpartition(".")[0])
        if shard is not None:  # expert parallelism: this rank's block of the (experts, ...) stack
            local = index[0] if index[0] is not None else torch.arange(shard.stop - shard.start)
            index[0] = torch.as_tensor(shard.expert_rows())[local]  # slots may hold any experts, in any order
            shape = torch.Size([shard.n_experts, *shape[1:]])
        target = param.to_local() if hasattr(param, "to_local") else param
        return shape, index, target

    return locate


def materialize(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device | str,
                source: WeightSource | None = None) -> nn.Module:
    """Allocate this rank's part of `model` on `device` and fill it from `source` (default:
    drawn from `seed`): the same full weights in every layout."""
    return fill_weights(model, device, source or RandomWeights(cfg, seed), _locate_in(model))
