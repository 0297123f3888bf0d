"""Tensor parallelism of multi-head latent attention, split as Megatron-Core and SGLang split it.

The heads are split over "tp": the up-projections `wq_b` (or the plain `wq`) and `wkv_b` by
output columns (each rank computes its heads' queries, keys and values), the output
projection `wo` by input rows, exactly as grouped-query attention's matrices
(`tensor_parallel.block_plan`). The down-projections `wq_a` and `wkv_a` and the two latent
norms are small (d x (q_lora_rank + kv_lora_rank + qk_rope_head_dim)) and stay replicated:
every rank computes the whole latents (Megatron-Core's "duplicated" linear layers of
MLASelfAttention, SGLang's ReplicatedLinear q_a_proj / kv_a_proj_with_mqa).

One gradient needs care. The latents reach the heads through `wkv_b` / `wq_b`, whose
column-parallel input all-reduces its gradient, so they get the whole gradient on every rank.
The rotated key part goes from `wkv_a` straight into attention with this rank's heads only:
its gradient is this rank's share of a sum over heads. `reduce_rope_key_grad` makes that
slice of `wkv_a`'s output an identity in forward whose gradient is all-reduced over tp in
backward (Megatron's "copy to tensor-parallel region"), so the replicated weights receive the
same, whole, gradient on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over `group`."""
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def latent_plan() -> dict[str, object]:
    """Module name inside a block -> parallel style, for latent attention's split matrices."""
    return {"attention.wq_b": ColwiseParallel(), "attention.wkv_b": ColwiseParallel()}


def reduce_rope_key_grad(attention: nn.Module, tp_mesh) -> None:
    """Sum the rotated key part's gradient over tp at `wkv_a`'s output (see the module docstring)."""
    group, rank = tp_mesh.get_group(), attention.rank

    def hook(module, inputs, output: torch.Tensor) -> torch.Tensor:
        latent, rope_key = output[..., :rank], output[..., rank:]  # (batch, seq, kv_lora_rank), (..., rope)
        return torch.cat([latent, _SumGradOverGroup.apply(rope_key, group)], dim=-1)

    attention.wkv_a.register_forward_hook(hook)
