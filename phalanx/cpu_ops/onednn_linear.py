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
parameters, hooks and state dict) and sets the routed experts' hook (`GroupedExperts.onednn`).

Blocked copies. Given a plain weight, oneDNN first copies it into its blocked layout, on every
call; for a few rows that copy costs as much as the product (each expert's ~8 rows of a decode
step). Where they fit in memory (`blocked_copies_fit`), each module also keeps oneDNN's blocked
copy of its weights (`BlockedWeight`, `BlockedExperts`: made on a weight's first product), and
its products read that. The copy is a second copy of the weights: the parameters stay the plain tensors
that everything else reads (state dict, tied embeddings, latent attention's absorbed weights,
expert re-placement), and a weight changed in place or replaced gets a new copy. The results
are the same fp32 products, though oneDNN may sum them in another order for the blocked
layout: equal to the plain product bit for bit at most shapes, ~1e-6 apart at others
(tests/test_onednn_linear.py). `benchmarks/cpu_matmul.py` prints blocked against plain oneDNN
on serve_load's shapes.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.model.moe import GroupedExperts

_WORKS: dict[torch.dtype, bool] = {}
_BLOCKING_WORKS: dict[torch.dtype, bool] = {}


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


def blocking_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear also takes its blocked copy of a `dtype` weight and gives the
    plain product's result (checked once)."""
    if dtype not in _BLOCKING_WORKS:
        _BLOCKING_WORKS[dtype] = onednn_works(dtype) and _agrees(dtype, blocked=True)
    return _BLOCKING_WORKS[dtype]


def _agrees(dtype: torch.dtype, blocked: bool = False) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype) for shape in ((2, 5, 48), (24, 48), (24,)))
            want = F.linear(x, weight, bias).float()
            got = onednn_linear(x, block(weight) if blocked else weight, bias).float()
    except Exception:  # a private op: missing overload, unsupported dtype: F.linear
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2  # bf16 rounds at ~4e-3
    return got.shape == want.shape and float((got - want).abs().max()) <= tolerance * float(want.abs().max())


BLOCKING_ROWS_HINT = 64
"""The rows oneDNN is told to expect when it lays out a blocked copy. `cpu_matmul.py`-style
timing (weights of 512 x 512 cycled through 96 MiB, 2 threads, us per product at 1 / 8 / 32 /
512 rows): plain 45 / 73 / 119 / 990; hint 1: 46 / 77 / 124 / 808 (no gain at few rows); hint
8: 45 / 51 / 76 / 666; hint 64: 38 / 46 / 71 / 671; hint 512: 40 / 52 / 72 / 686."""


def block(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a plain (out, in) weight, an opaque mkldnn tensor that only its
    linear reads."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BLOCKING_ROWS_HINT)


class BlockedWeight:
    """A linear layer's blocked copy of its weight, with the address, shape and version of the
    plain weight it copies: a weight changed in place (its version counter moves) or replaced
    is copied again at its next product."""

    def __init__(self):
        self.state: tuple | None = None
        self.copy: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`sized_linear`, reading the blocked copy of `weight` where oneDNN runs."""
        if x.numel() // x.shape[-1] * weight.numel() < ONEDNN_MIN_MACS:
            return F.linear(x, weight, bias)
        state = (weight.data_ptr(), tuple(weight.shape), weight._version)
        if state != self.state:
            self.state, self.copy = state, block(weight)
        return onednn_linear(x, self.copy, bias)


class BlockedExperts:
    """Blocked copies of routed experts' weights, stacked (experts, out, in) as `GroupedExperts`
    holds them: per expert, w1 and w3 stacked into one (2 * hidden, dim) copy, so that the gate
    and up products are one oneDNN call over twice the columns (each output column still its
    own sum), and w2 as it is. A copy is remade when its stack changed in place or was replaced
    (its address or version counter moved, as expert re-placement's `copy_` moves it).

    `benchmarks/serve_step_ab.py --variant fused-gate-up` (serve_load.py's MoE closed loop, each
    engine step run one way or the other in turn): against one copy per weight looked up per
    product (`BlockedWeight`'s way), the steps took 1.042x less time (five pairs of runs,
    1.021-1.046); against per-weight copies made once and never looked up, 1.017x."""

    def __init__(self):
        self.copies: dict[tuple, tuple[tuple, torch.Tensor]] = {}

    def ffn(self, rows: torch.Tensor, expert: int, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
        """SwiGLU of `rows` with expert `expert`'s weights, w2(silu(w1 x) * w3 x): as
        `sized_linear` would, oneDNN from ONEDNN_MIN_MACS multiply-adds a product on."""
        if rows.shape[0] * w1.shape[1] * w1.shape[2] < ONEDNN_MIN_MACS:
            return F.linear(F.silu(F.linear(rows, w1[expert])) * F.linear(rows, w3[expert]), w2[expert])
        gate, up = onednn_linear(rows, self._copy("gate_up", expert, (w1, w3))).chunk(2, dim=-1)
        return onednn_linear(F.silu(gate) * up, self._copy("down", expert, (w2,)))

    def _copy(self, name: str, expert: int, stacks: tuple[torch.Tensor, ...]) -> torch.Tensor:
        state = tuple((stack.data_ptr(), stack._version) for stack in stacks)
        held = self.copies.get((name, expert))
        if held is None or held[0] != state:
            held = self.copies[(name, expert)] = (state, block(torch.cat([stack[expert] for stack in stacks])))
        return held[1]


BLOCKED_MEMORY_SHARE = 0.25
"""Blocked copies are kept when all of them (every rank of this machine's) take at most this
share of the memory available at load: a policy, not a measurement. The copies are a second
copy of the weights, and the rest must stay free for the KV pool (1 GiB by default), the
activations and the machine's other work."""


def blocked_copies_fit(model: nn.Module) -> bool:
    """Whether blocked copies of `model`'s plain CPU weights, times the ranks this machine
    runs (torchrun's LOCAL_WORLD_SIZE), fit in BLOCKED_MEMORY_SHARE of the available memory."""
    available = _available_memory()
    copies = _plain_cpu_weight_bytes(model) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return available is not None and copies <= BLOCKED_MEMORY_SHARE * available


def _plain_cpu_weight_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for param in model.parameters():
        if type(param) in (torch.Tensor, nn.Parameter) and param.device.type == "cpu" and param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    return total


def _available_memory() -> int | None:
    """The kernel's estimate of memory available without swapping (Linux), else None."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """This product may run through oneDNN: no gradient wanted, plain CPU tensors of one dtype."""
    return (not torch.is_grad_enabled() and x.device.type == "cpu" and type(weight) in (torch.Tensor, nn.Parameter)
            and weight.device.type == "cpu" and x.dtype == weight.dtype and onednn_works(weight.dtype))


class OneDnnLinear(nn.Linear):
    """nn.Linear whose forward takes oneDNN's GEMM when `usable` (see the module docstring)."""

    blocked: BlockedWeight | None = None
    """Its weight's blocked copy, where `use_onednn` keeps them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Traced by torch.compile (`serve/compiled_decode.py`): the plain product, which
        # inductor itself lowers to oneDNN on packed weights.
        if not torch.compiler.is_compiling() and usable(x, self.weight):
            return (self.blocked.linear if self.blocked else sized_linear)(x, self.weight, self.bias)
        return super().forward(x)


def expert_product(rows: torch.Tensor, w1: torch.Tensor):
    """The routed experts' hook (`GroupedExperts.onednn`): `sized_linear` where oneDNN may
    multiply these rows (`usable`), else None (the experts' own F.linear)."""
    return sized_linear if usable(rows, w1) else None


def use_onednn(model: nn.Module, blocked: bool | None = None) -> int:
    """Re-class every plain-CPU-weight `nn.Linear` of `model` as `OneDnnLinear` and let its
    routed experts use oneDNN; return how many modules changed. A no-op off the CPU, where
    oneDNN's linear is unavailable, or for modules with DTensor weights. `blocked`: keep
    blocked copies of the weights (None: where `blocked_copies_fit`)."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and type(module.weight) in (torch.Tensor, nn.Parameter):
            if module.weight.device.type == "cpu" and onednn_works(module.weight.dtype):
                module.__class__ = OneDnnLinear
                changed += 1
        elif isinstance(module, GroupedExperts) and type(module.w1) in (torch.Tensor, nn.Parameter):
            if module.w1.device.type == "cpu" and onednn_works(module.w1.dtype):
                module.onednn = expert_product
                changed += 1
    if blocked is None:
        blocked = blocked_copies_fit(model)
    for module in model.modules():
        if isinstance(module, OneDnnLinear) and blocked and blocking_works(module.weight.dtype):
            module.blocked = BlockedWeight()
        elif isinstance(module, GroupedExperts) and module.onednn and blocked and blocking_works(module.w1.dtype):
            module.blocked = BlockedExperts()
    return changed
