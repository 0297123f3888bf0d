"""PyTorch's default CPU linear (MKL's sgemm) against oneDNN's (`cpu_ops/onednn_linear.py`), on
the serving benchmark's shapes, alternating in the same process; and oneDNN reading its blocked
copy of each weight (`BlockedWeights`, what `phalanx serve` keeps where it fits) against oneDNN
given the plain weight, which it copies into that layout on every call.

Shapes (rows x in -> out, fp32): serve_load.py's llama feed-forward (512 -> 2048) at 1 row (one
sequence decoding), 8 (one expert's share of a 32-sequence MoE decode), 32 (the closed loop's
full decode batch) and 512 rows (a prefill step's token budget), and its MoE expert
(512 -> 512) at 8 rows; then small products around `ONEDNN_MIN_MACS` (one row of 256 -> 256
and 512 -> 512, a 32-row router of 512 -> 8, one row of 1024 -> 1024), where oneDNN's fixed
cost per call decides. Per shape: the median over --repeats timings of each, GFLOP/s, the
ratios oneDNN / MKL and blocked / oneDNN, and the largest difference of the two results relative to the largest
output (the same fp32 products summed in another order). A weight pool larger than the last-level cache is cycled
through, as a served model's layers are, unless --hot.

    .venv/bin/python benchmarks/cpu_matmul.py [--threads 1] [--repeats 7] [--hot]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phalanx.cpu_ops.onednn_linear import block, blocking_works, onednn_linear, onednn_works  # noqa: E402

SHAPES = [(1, 512, 2048), (8, 512, 2048), (32, 512, 2048), (512, 512, 2048), (8, 512, 512),
          (1, 256, 256), (32, 512, 8), (1, 512, 512), (1, 1024, 1024)]
POOL_BYTES = 96 << 20
"""Weights cycled through: three times a 32 MiB last-level cache."""


def timed(fn, weights, x, calls: int) -> float:
    began = time.perf_counter()
    for index in range(calls):
        fn(x, weights[index % len(weights)])
    return (time.perf_counter() - began) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hot", action="store_true", help="one weight, always in cache")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not onednn_works(torch.float32):
        sys.exit("oneDNN's linear does not run in this torch: phalanx keeps F.linear here")
    print(f"fp32 linear, {torch.get_num_threads()} threads, weights {'hot' if args.hot else 'cycled over 96 MiB'}, "
          f"load {os.getloadavg()[0]:.1f}")
    blocking = blocking_works(torch.float32)
    print(f"{'rows x in -> out':>20} {'MKL GFLOP/s':>12} {'oneDNN GFLOP/s':>15} {'oneDNN / MKL':>13} {'max diff/max':>13}"
          f"{' blocked GFLOP/s  blocked / oneDNN' if blocking else ''}")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows, dim_in, dim_out in SHAPES:
            count = 1 if args.hot else max(1, POOL_BYTES // (dim_in * dim_out * 4))
            weights = [torch.randn(dim_out, dim_in, generator=generator) / dim_in ** 0.5 for _ in range(count)]
            x = torch.randn(rows, dim_in, generator=generator)
            calls = max(20, int(2e9 / (2 * rows * dim_in * dim_out)) // 10)
            blocked = [block(weight) for weight in weights] if blocking else []
            mkl, onednn, onednn_blocked = [], [], []
            for fn, pool in ((F.linear, weights), (onednn_linear, weights), (onednn_linear, blocked)):
                if pool:  # warm-up: oneDNN builds its kernel for the shape once
                    timed(fn, pool, x, calls)
            for _ in range(args.repeats):
                mkl.append(timed(F.linear, weights, x, calls))
                onednn.append(timed(onednn_linear, weights, x, calls))
                if blocking:
                    onednn_blocked.append(timed(onednn_linear, blocked, x, calls))
            flop = 2 * rows * dim_in * dim_out
            rate_mkl, rate_onednn = flop / statistics.median(mkl) / 1e9, flop / statistics.median(onednn) / 1e9
            want = F.linear(x, weights[0])
            diff = float((onednn_linear(x, weights[0]) - want).abs().max() / want.abs().max())
            line = (f"{f'{rows} x {dim_in} -> {dim_out}':>20} {rate_mkl:>12.1f} {rate_onednn:>15.1f} "
                    f"{rate_onednn / rate_mkl:>12.2f}x {diff:>13.1e}")
            if blocking:
                rate_blocked = flop / statistics.median(onednn_blocked) / 1e9
                line += f" {rate_blocked:>16.1f} {rate_blocked / rate_onednn:>16.2f}x"
            print(line)


if __name__ == "__main__":
    main()
