"""Time the experts' forward + backward: per-expert loop vs one torch._grouped_mm per weight.

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/grouped_experts.py

Same rows, counts and weights for both; repeats interleaved A B B A so both sides see the same
machine load; prints medians. Uniform routing and a skewed one (~60% of rows to expert 0).
"""

from __future__ import annotations

import time

import torch

from phalanx.model.moe import grouped_expert_ffn, grouped_mm_expert_ffn, grouped_mm_works

SHAPES = [(8, 64, 64, 512), (8, 256, 512, 8192), (64, 256, 256, 8192)]
"""(experts, dim, hidden, rows): tiny-moe's layer, the DeepSpeed benchmark's, many small experts."""


def one_case(n_experts: int, dim: int, hidden: int, rows: int, skewed: bool, repeats: int = 3) -> None:
    weight = torch.ones(n_experts)
    if skewed:
        weight[0] = 1.5 * n_experts  # expert 0 gets ~60% of the rows
    counts = torch.bincount(torch.multinomial(weight, rows, replacement=True), minlength=n_experts)
    x = torch.randn(rows, dim, requires_grad=True)
    w1, w3 = ((torch.randn(n_experts, hidden, dim) / dim**0.5).requires_grad_() for _ in range(2))
    w2 = (torch.randn(n_experts, dim, hidden) / hidden**0.5).requires_grad_()
    grad = torch.randn(rows, dim)
    runs = {
        "loop": lambda: grouped_expert_ffn(x, counts.tolist(), w1, w2, w3),
        "grouped_mm": lambda: grouped_mm_expert_ffn(x, counts, w1, w2, w3),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for name in ("loop", "grouped_mm", "grouped_mm", "loop") * repeats:
        began = time.perf_counter()
        torch.autograd.grad(runs[name](), [x, w1, w2, w3], grad)
        seconds[name].append(time.perf_counter() - began)
    median = {name: sorted(v)[len(v) // 2] * 1e3 for name, v in seconds.items()}
    print(f"experts={n_experts} dim={dim} hidden={hidden} rows={rows} {'skewed' if skewed else 'uniform'}: "
          f"loop {median['loop']:.1f} ms, grouped_mm {median['grouped_mm']:.1f} ms, "
          f"loop/grouped_mm {median['loop'] / median['grouped_mm']:.2f}x")


def main() -> None:
    torch.manual_seed(0)
    probe = torch.empty(1, 64)
    if not grouped_mm_works(probe, torch.empty(1, 64, 64)):
        raise SystemExit("torch._grouped_mm does not work on this CPU/torch: only the loop runs here")
    for shape in SHAPES:
        for skewed in (False, True):
            one_case(*shape, skewed)


if __name__ == "__main__":
    main()
