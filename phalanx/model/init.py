"""Build on the meta device, then materialize with weights that do not depend on the layout.

Every parameter's full value is drawn from its own generator, seeded by the run seed and the
parameter's name, or read from a checkpoint (`phalanx.hf.weights`). A rank keeps only its
slice (a DTensor shard under TP or FSDP, its block of experts under EP), so the same seed or
checkpoint yields the same full weights for one process or for any dp x tp x pp x ep layout,
and a pipeline stage that lacks a layer simply never reads it.
"""

from __future__ import annotations

import math
import zlib
from typing import Protocol

import torch
from torch import nn

from phalanx.model.config import ModelConfig
from phalanx.model.transformer import Transformer

# Wrappers that insert themselves into parameter names; stripped so names match the model's.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.removeprefix("module.")


def build_model(cfg: ModelConfig) -> Transformer:
    """The model with every tensor on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return Transformer(cfg)


def _full_value(name: str, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = 0.02
    # Projections back into the residual stream are scaled down by depth (GPT-2 / Llama practice)
    # so the residual variance does not grow with the number of layers.
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.experts.w2")):
        std = 0.02 / math.sqrt(2 * cfg.n_layers)
    return torch.randn(shape, generator=generator) * std


class RandomWeights:
    """Weights drawn from the run seed: each full tensor from a generator seeded by its name."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.cfg, self.seed = cfg, seed

    def read(self, name: str, shape: torch.Size, index: list[torch.Tensor | None]) -> torch.Tensor:
        full = _full_value(name, shape, self.cfg, self.seed)
        for dim, rows in enumerate(index):
            if rows is not None:
                full = full.index_select(dim, rows)
        return full


class WeightSource(Protocol):
    def read(self, name: str, shape: torch.Size, index: list[torch.Tensor | None]) -> torch.Tensor:
        """Parameter `name` (canonical, of full shape `shape`) restricted to `index`: per dim,
        the global rows this rank keeps (a LongTensor), or None for all of them."""


def local_index(param: torch.Tensor) -> list[torch.Tensor | None]:
    """Per dim, which global rows of `param` this rank stores (None: all of them).

    For a DTensor, each dim's row numbers are distributed with the placements that shard that
    dim (others replicated), exactly as `distribute_tensor` would split the full value,
    uneven and nested (tp then fsdp) shards included; `src_data_rank=None` splits locally,
    with no communication."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

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


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device | str,
                 source: WeightSource | None = None) -> nn.Module:
    """Materialize a meta-device model on `device` and fill it from `source` (default: drawn
    from `seed`), each rank reading only the rows it keeps."""
    source = source or RandomWeights(cfg, seed)
    model.to_empty(device=device)
    for module in model.modules():  # to_empty gives each module its own tensor: tie again
        if hasattr(module, "tie_weights"):
            module.tie_weights()
    for name, param in model.named_parameters():
        index = local_index(param)
        shape = param.shape
        shard = getattr(model.get_submodule(name.rpartition(".")[0]), "expert_shard", None)
        if shard is not None:  # expert parallelism: this rank's block of the (experts, ...) stack
            start, stop, total = shard
            index[0] = (index[0] if index[0] is not None else torch.arange(stop - start)) + start
            shape = torch.Size([total, *shape[1:]])
        local = source.read(canonical_name(name), shape, index).to(param.dtype)
        target = param.to_local() if hasattr(param, "to_local") else param
        target.copy_(local.to(target.device))
    for module in model.modules():
        if hasattr(module, "reset_buffers"):  # Transformer's rotary tables, routers' biases
            module.reset_buffers()
    return model
