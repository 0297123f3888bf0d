"""oneDNN's GEMM for inference on CPU: the linear layers and the routed experts.

PyTorch's CPU matmul (`F.linear`, `torch.mm`) runs MKL's sgemm. On the AMD EPYC (Zen 5,
AVX-512) these machines have, MKL takes a slower path than oneDNN (which PyTorch also ships,
for its bf16 and quantized kernels, and inductor emits as `mkldnn._linear_pointwise`) on the
same fp32 product. `benchmarks/cpu_matmul.py` (2 threads, weights cycled through 96 MiB as a
served model's layers are): (32 x 512) @ (512 x 2048), the serving benchmark's decode shape,
105 GFLOP/s through MKL and 191 through oneDNN (1.82x); 2.36x at 512 rows (a prefill step),
1.64x at 1 and 8 rows, 1.36x for an MoE expert's 8 rows of 512 x 512. The results are the same
fp32 sums in another order: within 1e-6 of the largest output.

Inference only: a layer takes this path while autograd is off (serving, generation) and its
weight is a plain CPU tensor; with gradients on (training) or a DTensor weight (a
tensor-parallel shard that still dispatches) it is `nn.Linear` as before. The op is private
(`torch.ops.mkldnn._linear_pointwise`, what inductor emits for CPU linears): it is tried once
per dtype on a small product against `F.linear`, and any error or disagreement means
`F.linear` (tests/test_onednn_linear.py skips, saying so, where it does not work). Products
under ONEDNN_MIN_MACS multiply-adds stay F.linear, where oneDNN's fixed cost per call is more
than its gain.

`use_onednn(model)` is applied from outside, after loading (`serve/loading.py`,
`generate/cli.py`): it re-classes each eligible `nn.Linear` as `OneDnnLinear` (same
parameters, hooks and state dict) and marks the routed experts (`GroupedExperts.onednn`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_WORKS: dict[torch.dtype, bool] = {}


ONEDNN_MIN_MACS = 1 << 18
"""Below this many multiply-adds (rows x in x out) a product stays F.linear: oneDNN's call
costs about 10 us more than MKL's. `benchmarks/cpu_matmul.py`, 2 threads: with the weight in
cache (`--hot`) MKL is faster on one row of 256 -> 256 (65K multiply-adds, oneDNN 0.32x) and
a 32-row router of 512 -> 8 (131K, 0.40x); at one row of 512 -> 512 (262K) oneDNN is 0.79x hot
but 1.83x with the weights streamed from memory, as a served model's are once it outgrows the
cache; from 1M on (one row of 1024 -> 1024) it is 1.40x and 2.00x. So the line is drawn at
262K: a small model's smallest products keep MKL, the rest take oneDNN."""


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) through oneDNN (the caller checked `onednn_works`)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def sized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): through oneDNN from ONEDNN_MIN_MACS multiply-adds on, else MKL's
    (the caller checked `usable`)."""
    if x.numel() // x.shape[-1] * weight.numel() >= ONEDNN_MIN_MACS:
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs here for `dtype` and agrees with F.linear (checked once)."""
    if dtype not in _WORKS:
        _WORKS[dtype] = _agrees(dtype)
    return _WORKS[dtype]


def _agrees(dtype: torch.dtype) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype) for shape in ((2, 5, 48), (24, 48), (24,)))
            got, want = onednn_linear(x, weight, bias).float(), F.linear(x, weight, bias).float()
    except Exception:  # a private op: missing overload, unsupported dtype: F.linear
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2  # bf16 rounds at ~4e-3
    return got.shape == want.shape and float((got - want).abs().max()) <= tolerance * float(want.abs().max())


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """This product may run through oneDNN: no gradient wanted, plain CPU tensors of one dtype."""
    return (not torch.is_grad_enabled() and x.device.type == "cpu" and type(weight) in (torch.Tensor, nn.Parameter)
            and weight.device.type == "cpu" and x.dtype == weight.dtype and onednn_works(weight.dtype))


class OneDnnLinear(nn.Linear):
    """nn.Linear whose forward takes oneDNN's GEMM when `usable` (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if usable(x, self.weight):
            return sized_linear(x, self.weight, self.bias)
        return super().forward(x)


def use_onednn(model: nn.Module) -> int:
    """Re-class every plain-CPU-weight `nn.Linear` of `model` as `OneDnnLinear` and let its
    routed experts use oneDNN; return how many modules changed. A no-op off the CPU, where
    oneDNN's linear is unavailable, or for modules with DTensor weights."""
    from phalanx.model.moe import GroupedExperts

    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and type(module.weight) in (torch.Tensor, nn.Parameter):
            if module.weight.device.type == "cpu" and onednn_works(module.weight.dtype):
                module.__class__ = OneDnnLinear
                changed += 1
        elif isinstance(module, GroupedExperts) and type(module.w1) in (torch.Tensor, nn.Parameter):
            if module.w1.device.type == "cpu" and onednn_works(module.w1.dtype):
                module.onednn = True
                changed += 1
    return changed
