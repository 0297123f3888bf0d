"""Fused causal attention's and a large matrix multiply's fraction of peak on this device,
beside the planner's `attention_efficiency` and `matmul_efficiency` for it.

    PYTHONPATH=. python benchmarks/attention_efficiency.py --device cuda   # a GPU: Llama 3 405B's shapes
    PYTHONPATH=. python benchmarks/attention_efficiency.py --device cpu --quick   # seconds, tiny shapes

Why: `attention_efficiency` (0.50 in the GPU presets) was set before any published row was
run, without a measurement, and the Llama 3 405B row at 131,072 tokens (planner_published.py)
is the one published row whose step is mostly attention. An H200 has the H100's compute (the
same GH100 die and SM count, 989 dense bf16 TFLOP/s), so what it measures here is what the
dgx-h100 rows run at; attention is compute-bound, so the H200's faster memory does not enter.

What is timed: scaled_dot_product_attention(is_causal=True) forward and backward in bf16 (on
CUDA PyTorch picks its fused flash kernel) at the per-rank shape of Llama 3 405B under tp 8:
16 query heads sharing one KV head (`enable_gqa`, as phalanx's attention calls it), head dim 128. Cost is counted as the planner counts
it: forward 0.5 x 4 T s h (the causal half), backward 2.5 x that. Two sequence lengths are
timed, and the efficiency is the slope between them (as `phalanx calibrate` measures it), so
that the fixed cost of each call cancels; each length's own figure is printed as well. The
matrix multiply is m = n = k = 8192 (4096 with --quick), the size of a 405B GEMM per tp rank.
The ratio printed last, measured attention over measured matmul efficiency, is what the
planner's two constants assume as 0.50 / 0.70 = 0.71.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, KV_HEADS, HEAD_DIM = 16, 1, 128
"""Llama 3 405B per tp rank at tp 8: 128 query heads and 8 KV heads of dimension 128."""


def best_time(run, device, repeats: int) -> float:
    import torch

    run()  # warm-up: kernel selection, allocator
    if device.type == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def attention_point(device, dtype, seq: int, heads: int, head_dim: int, repeats: int) -> tuple[float, float]:
    """(the planner's FLOPs, seconds) of one causal forward + backward at `seq` tokens."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    kv = [torch.randn(1, KV_HEADS, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2)]

    def run():  # grouped-query attention as phalanx's attention calls it: the KV head shared by all 16
        F.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=True).sum().backward()

    flops = 3.5 * 0.5 * 4 * seq * seq * heads * head_dim
    return flops, best_time(run, device, repeats)


def matmul_seconds(device, dtype, size: int, repeats: int) -> float:
    import torch

    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    return best_time(lambda: torch.matmul(a, b), device, repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--cluster", default="",
                        help="the planner cluster whose peak and efficiencies are compared (default: the GPU's preset, "
                             "`local` on the CPU)")
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats (the device check's dry run)")
    args = parser.parse_args()

    import torch

    from phalanx.planner.hardware import cluster_from_name, this_machine

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu")
        return 2
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    cluster = cluster_from_name(args.cluster or (this_machine(name) if device.type == "cuda" else "local"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = cluster.peak_flops_per_rank(1)
    if device.type == "cuda":
        seqs, heads, head_dim, size, repeats = ((2048, 8192) if args.quick else (8192, 32768)), HEADS, HEAD_DIM, \
            (4096 if args.quick else 8192), (3 if args.quick else 10)
    else:  # tiny shapes: a check of the script, not a figure of the CPU
        seqs, heads, head_dim, size, repeats = (128, 512), 2, 32, 256, 2
    print(f"device {name}, {str(dtype).removeprefix('torch.')}, cluster {cluster.name} (peak {peak / 1e12:.1f} TFLOP/s), "
          f"{heads} query heads, 1 KV head, head dim {head_dim}")
    points = [attention_point(device, dtype, seq, heads, head_dim, repeats) for seq in seqs]
    for seq, (flops, seconds) in zip(seqs, points):
        print(f"causal attention seq {seq:6d}: {flops / seconds / 1e12:8.1f} TFLOP/s, {flops / seconds / peak:.3f} of peak "
              f"({seconds * 1e3:.2f} ms)")
    (f1, t1), (f2, t2) = points
    if t2 > t1:
        attention, how = (f2 - f1) / (t2 - t1) / peak, f"slope {seqs[0]} -> {seqs[1]}"
    else:  # timing noise at small shapes: the longer point's own rate, fixed costs included (a lower bound)
        attention, how = f2 / t2 / peak, f"seq {seqs[1]} alone: the longer sequence was not slower"
    seconds = matmul_seconds(device, dtype, size, repeats)
    matmul = 2 * size**3 / seconds / peak
    print(f"attention efficiency ({how}): {attention:.3f}; the planner's: "
          f"{cluster.attention_efficiency:.3f} (measured / planner {attention / cluster.attention_efficiency:.2f})")
    print(f"matmul efficiency ({size}^3): {matmul:.3f}; the planner's: {cluster.matmul_efficiency:.3f} "
          f"(measured / planner {matmul / cluster.matmul_efficiency:.2f})")
    print(f"attention / matmul efficiency: measured {attention / matmul:.2f}, planner "
          f"{cluster.attention_efficiency / cluster.matmul_efficiency:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
