"""Build on the meta device, then materialize with weights that do not depend on the layout.

Every parameter's full value is drawn from its own generator, seeded by the run seed and the
parameter's name. A rank then keeps only its slice (a DTensor shard under TP or FSDP), so the
same seed yields the same full weights for one process or for any dp x tp x pp x ep layout,
and a pipeline stage that lacks a layer simply never draws it.
"""

from __future__ import annotations

import math
import zlib

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
    std = 0.02
    # Projections back into the residual stream are scaled down by depth (GPT-2 / Llama practice)
    # so the residual variance does not grow with the number of layers.
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.experts.w2")):
        std = 0.02 / math.sqrt(2 * cfg.n_layers)
    return torch.randn(shape, generator=generator) * std


def _local_part(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The slice of `full` that this rank stores for `param` (itself, unless a DTensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already holds the same full tensor, so split locally
        # without communication.
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return full


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device | str) -> nn.Module:
    """Materialize a meta-device model on `device` and fill it deterministically."""
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        shard = getattr(model.get_submodule(name.rpartition(".")[0]), "expert_shard", None)
        if shard is None:
            full = _full_value(canonical_name(name), param.shape, cfg, seed)
        else:  # expert parallelism: draw the whole (experts, ...) stack, keep this rank's rows
            start, stop, total = shard
            full = _full_value(canonical_name(name), torch.Size([total, *param.shape[1:]]), cfg, seed)[start:stop]
        local = _local_part(full, param).to(param.dtype)
        target = param.to_local() if hasattr(param, "to_local") else param
        target.copy_(local.to(target.device))
    for module in model.modules():
        if hasattr(module, "reset_buffers"):  # Transformer's rotary tables, routers' biases
            module.reset_buffers()
    return model
