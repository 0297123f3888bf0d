"""Build on the meta device, then materialize with weights that do not depend on the layout.

Every parameter's full value is drawn from its own generator, seeded by the run seed and the
parameter's name, or read from a checkpoint (`phalanx.hf.weights`). A rank keeps only its
slice (what it holds is told by a `Locate`; for parallel layouts see
`phalanx.parallel.materialize`), so the same seed or checkpoint yields the same full weights
for one process or for any dp x tp x pp x ep layout, and a pipeline stage that lacks a layer
simply never reads it.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Protocol

import torch
from torch import nn

from phalanx.errors import UserError
from phalanx.model.config import ModelConfig
from phalanx.model.shape_bounds import build_problem
from phalanx.model.transformer import Transformer

# Wrappers that insert themselves into parameter names; stripped so names match the model's.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.removeprefix("module.")


def build_model(cfg: ModelConfig) -> Transformer:
    """The model with every tensor on the meta device: shapes only, no memory."""
    if problem := build_problem(cfg):  # before one module of a 10^12-layer model file is made
        raise UserError(problem)
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


Locate = Callable[[str, torch.Tensor], tuple[torch.Size, list[torch.Tensor | None], torch.Tensor]]
"""(name, parameter) -> (the full shape, per dim the global rows this rank keeps or None for
all, the tensor to fill): how a layout tells `fill_weights` what each rank holds."""


def whole(name: str, param: torch.Tensor) -> tuple[torch.Size, list[torch.Tensor | None], torch.Tensor]:
    """A single-device model: every parameter is whole."""
    return param.shape, [None] * param.ndim, param


@torch.no_grad()
def fill_weights(model: nn.Module, device: torch.device | str, source: WeightSource, locate: Locate = whole) -> nn.Module:
    """Materialize a meta-device model on `device` and fill each parameter's part (`locate`)
    from `source`, reading only those rows."""
    model.to_empty(device=device)
    for module in model.modules():  # to_empty gives each module its own tensor: tie again
        if hasattr(module, "tie_weights"):
            module.tie_weights()
    for name, param in model.named_parameters():
        shape, index, target = locate(name, param)
        local = source.read(canonical_name(name), shape, index).to(param.dtype)
        target.copy_(local.to(target.device))
    for module in model.modules():
        if hasattr(module, "reset_buffers"):  # Transformer's rotary tables, routers' biases
            module.reset_buffers()
    read_buffer = getattr(source, "read_buffer", None)  # a checkpoint's buffers (DeepSeek-V3's router bias)
    if read_buffer is not None:
        for name, buffer in model.named_buffers():
            value = read_buffer(canonical_name(name))
            if value is not None:
                buffer.copy_(value.to(buffer.device, buffer.dtype))
    return model


def init_weights(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device | str,
                 source: WeightSource | None = None) -> nn.Module:
    """Materialize a single-device meta model on `device`, filled from `source` (default:
    drawn from `seed`). A parallel layout's part: `phalanx.parallel.materialize`."""
    return fill_weights(model, device, source or RandomWeights(cfg, seed))
