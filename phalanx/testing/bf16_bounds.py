"""How far a bf16 layout may drift from the bf16 one-process run, and why.

bf16 keeps 8 significant bits: each rounding moves a value by up to 2^-9 = 2e-3 relative. Every
layout computes with bf16 copies of the same fp32 master weights (parallel/mixed_precision.py),
but rounds in other places than one process: the bf16 residual stream and activations come out
of matmuls whose sums another batch split or tensor parallelism orders differently (tp also adds
row-parallel partial sums in bf16); bf16 reduction rounds each rank's gradient before the sum.
Measured values below: `PYTHONPATH=. python tests/test_mixed_precision.py` (DDP, zero=3, tp=2
with sp, pp=2, tiny-moe dp=2,ep=2, on a CPU without native bf16 dot products), and before that
for autocast over fp32 weights (the older mode, `param_dtype=fp32`), by the layout tests.

- Losses: single roundings are ~2e-3 relative but averaged over 256 tokens per step, so the
  losses of 4 steps stay within BF16_LOSS = 5e-3 (measured <= 9e-4; autocast <= 1.3e-3).
- Gradient norm, first step: the weights are still identical, so only rounding differs:
  within BF16_FIRST_GRAD_NORM = 1% (measured <= 0.12%). A missing gradient reduction fails here:
  half of the tests' batch has a gradient norm 31% above the whole batch's (4.65 vs 3.55 for
  `tiny` on the one-file corpus), and a doubled one is 100% off.
- Gradient norm, later steps: AdamW moves each weight by about lr per step whatever the
  gradient's size, so a weight whose gradient is near zero may step either way in two runs, and
  the runs' weights, hence their gradients, part. How fast depends on the CPU's bf16 kernels: on
  a CPU with native bf16 dot products (avx512_bf16) the fp32 and bf16 one-process runs' norms
  differ by 8% at step 4 and two bf16 layouts by up to 7% (autocast); elsewhere under 1% with
  autocast, and up to 3% with the bf16 residual stream of mixed precision. Bound:
  BF16_GRAD_NORM = 10%.
- Weights: for the same reason compared by their mean absolute difference, BF16_WEIGHT_MEAN =
  5e-4, a tenth of one step's move (measured <= 1.3e-4; autocast <= 1.5e-4). A missing or
  doubled reduction moves every weight by a full step.
"""

from __future__ import annotations

BF16_LOSS = 5e-3
BF16_FIRST_GRAD_NORM = 1e-2
BF16_GRAD_NORM = 1e-1
BF16_WEIGHT_MEAN = 5e-4


def bf16_grad_norm_bound(step: int) -> float:
    """Relative bound on a bf16 layout's gradient norm at `step` (1-based) against one process."""
    return BF16_FIRST_GRAD_NORM if step == 1 else BF16_GRAD_NORM
