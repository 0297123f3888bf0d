"""Tensor parallelism for inference: the blocks' matrices as plain local shards.

`apply_tp` makes every block matrix a DTensor, so each of its matmuls goes through DTensor's
sharding propagation, which is cached by the input's shape. A training run sees one shape;
serving sees a new token count nearly every step, and each new shape costs tens of
milliseconds of CPU per matrix (torch 2.13: 37 ms a propagation, profiled on a tp=2 layout of
tests/test_hybrid_layouts.py), on the engine's critical path.

A Megatron block needs none of that at inference. A column-parallel matrix multiplies the
replicated input by this rank's rows of the weight, with no communication; a row-parallel one
multiplies this rank's slice of the input by its columns, and the partial results are summed
over tp. So, without gradients, each block matrix becomes its local shard and each
row-parallel output is all-reduced in place: the same products and the same reduction, over
the same group, that DTensor's Partial -> Replicate runs. The embedding and the output
projection keep their DTensor styles (the vocabulary-parallel lookup and the sharded logits:
two ops a forward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from phalanx.parallel.latent_tp import latent_plan
from phalanx.parallel.tensor_parallel import block_plan

ROWWISE = ("attention.wo", "feed_forward.w2")
"""The row-parallel matrices of `block_plan` (its others, and latent_plan's, are column-parallel)."""


def localize_block_matrices(model: nn.Module, tp_group) -> int:
    """Turn the column- and row-parallel matrices of every block of a tp-sharded, eval-mode
    `model` into their local shards (see the module docstring); return how many. A matrix
    whose placement, bias or hooks are not those of the default styles is left as it is."""
    names = [*block_plan(sp=False), *latent_plan()]
    converted = 0
    for block in model.layers.values():
        for name in names:
            module = _submodule(block, name)
            rowwise = name in ROWWISE
            if not (isinstance(module, nn.Linear) and isinstance(module.weight, DTensor)
                    and tuple(module.weight.placements) == (Shard(1 if rowwise else 0),)
                    and not (rowwise and module.bias is not None) and _only_dtensor_hooks(module)):
                continue
            module.weight = nn.Parameter(module.weight.to_local(), requires_grad=False)
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias.to_local(), requires_grad=False)
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                hooks.clear()
            if rowwise:
                module.register_forward_hook(_sum_over(tp_group))
            converted += 1
    return converted


def _sum_over(group):
    def hook(module, inputs, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)  # this rank's partial product -> the whole sum
        return output

    return hook


def _submodule(root: nn.Module, name: str) -> nn.Module | None:
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None


def _only_dtensor_hooks(module: nn.Module) -> bool:
    """Whether every forward hook on `module` is one `parallelize_module` registered (so that
    clearing them removes only the DTensor conversions this module replaces)."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return all("torch/distributed/tensor" in getattr(getattr(h, "__code__", None), "co_filename", "") for h in hooks)
