"""RMSNorm that keeps only its input and `rstd` (one value per row) for backward.

torch's `rms_norm` is one fused kernel on CUDA (for a plain tensor with the weight's dtype) but a
composite of elementwise ops elsewhere, and autograd then saves what each op needs: the input
upcast to fp32, `rstd`, and the fp32 `x * rstd` (twice the input's bytes each for a 16-bit
input; `benchmarks/activation_probe.py` lists them). Megatron's and the fused kernel's
backward need only the input and `rstd`, recomputing `x * rstd` from them, which is what
`_RMSNormFunction` does. Forward computes exactly what torch's composite computes (fp32
arithmetic, the weight multiplied in fp32, the result cast to the input's dtype), so outputs are
bit-identical and gradients equal to rounding (tests/test_activation_cuts.py).

`RMSNorm` is an `nn.RMSNorm` (same parameter, same state_dict key `weight`), so Hugging Face
and DCP checkpoints load unchanged, and tensor parallelism's `SequenceParallel` style and FSDP
treat it as before: under sequence parallelism the input and the weight are DTensors, and every
op below is one DTensor runs shard by shard (the reductions are over the last dimension, which
sequence parallelism never splits); the weight's gradient then comes back as a partial sum
over the sequence shards, as it does from torch's own norm.
"""

from __future__ import annotations

import torch
from torch import nn


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, keep_rstd: list | None = None) -> torch.Tensor:
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
    if keep_rstd is not None:
        keep_rstd.append(rstd)
    out = x32 * rstd
    if weight is not None:
        out = out * weight  # in fp32, as torch's composite multiplies it
    return out.type_as(x)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        rstd: list[torch.Tensor] = []
        out = _rms_norm(x, weight, eps, rstd)
        ctx.save_for_backward(x, rstd[0], weight)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        x32, grad32 = x.float(), grad.float()
        normed = x32 * rstd  # recomputed instead of saved
        grad_weight = None
        if weight is not None and ctx.needs_input_grad[1]:
            # Summed over every dimension but the normalized one: (dim,)
            grad_weight = (grad32 * normed).sum(dim=tuple(range(grad.dim() - 1))).to(weight.dtype)
        grad_normed = grad32 * weight if weight is not None else grad32
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * rstd(x), rstd = (mean(x^2) + eps)^-1/2, in the order autograd runs the
            # composite's backward: the direct term, then the one through the mean.
            grad_rstd = (grad_normed * x32).sum(-1, keepdim=True)  # (..., 1)
            grad_mean = grad_rstd * -0.5 * rstd.pow(3)
            grad_x = (grad_normed * rstd + grad_mean / x.shape[-1] * 2 * x32).to(x.dtype)
        return grad_x, grad_weight, None


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` (last dimension only, as the model uses it) saving input and `rstd` only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused CUDA kernel already saves just these two, but it runs only for a plain
        # tensor whose dtype is the weight's (else the composite: "Mismatch dtype ... Cannot
        # dispatch to fused implementation"); a DTensor (sequence parallelism) takes the function.
        if x.is_cuda and type(x) is torch.Tensor and (self.weight is None or self.weight.dtype == x.dtype):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # nn.RMSNorm's default
        if not torch.is_grad_enabled() and type(x) is torch.Tensor:
            # Inference (generation, serving): the same arithmetic without the autograd function's
            # own cost per call, nine calls per layer-step of a served batch
            # (benchmarks/serve_step_ab.py --variant norm: 1.019x on the MoE closed loop, 1.001-1.022).
            return _rms_norm(x, self.weight, eps)
        return _RMSNormFunction.apply(x, self.weight, eps)

