"""Predicted vs published serving throughput: `phalanx plan --serve` against published runs.

The rows (phalanx/planner/serve/validation.json, each with its source and engine) are
TensorRT-LLM's perf-overview tables, v1.0 (PyTorch backend; Llama 3.1 8B, 3.3 70B, 3.1 405B,
Qwen3-235B-A22B, Qwen3-30B-A3B, Llama 4 Scout and Maverick on H100, H200, B200 and GB200, fp8
and fp4) and v0.17 (TensorRT engines; Llama 3.1 8B, 70B, 405B and Mixtral 8x7B, 8x22B on H200,
H100 fp8 and A100 fp16), the runs of shared/reference/published-figures.md section 5,
TensorRT-LLM's DeepSeek-R1 blog (H200 fp8, B200 fp4) and SGLang's large-scale EP deployment of
DeepSeek-V3 (prefill on 32 H100s, decode on 72 with 288 expert slots). Each is
evaluated at the layout, precision, lengths and load its source states (`--fix`; all requests
queued at once is a closed loop of that many requests; TensorRT-LLM's KV pool rule where the
row states it); nothing is fitted per row. Rows are
split into a 'visible' half, the only one any modelling choice may look at, and a 'holdout'
half kept out of every decision (the rule, fixed before their predictions were computed, is in
the file's `about`); the median |error| of each is printed (target: 15%), and with `--worst N`
the N rows of each half furthest off, with the step's largest cause.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_planner_published.py [--split visible] [--worst 8]

`--kernels` prints instead the step model's time of single GEMMs beside published kernel
timings (DeepGEMM's fp8 table on H800 and its CUTLASS baseline, its grouped MoE GEMM tables,
vLLM's fp8 and bf16 GEMMs on H100 and B200, cuBLASLt's fp4 GEMMs on B200), which chose the GPU
GEMM model.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from pathlib import Path

from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.model_spec import model_from_dict
from phalanx.planner.serve.costs import (GPU_CPP_EXECUTOR, GPU_ENGINE, GPU_FP4_FILL_S, GPU_KERNEL_FILL_S,
                                         TORCH_SAMPLER_HOST_S, ServeCosts, fp4_fill_seconds, kernel_fill_seconds)
from phalanx.planner.serve.memory import MAX_BATCH_LIMIT, PoolRule, trtllm_bench_max_num_tokens
from phalanx.planner.serve.rates import ServeLoad
from phalanx.planner.serve.search import parse_serve_fix, search_serving
from phalanx.planner.serve.step import (DECODE_ATTENTION_HBM_FRACTION, WEIGHT_BYTES, gemm_peak, gpu_gemm_time,
                                        one_gemm_time)
from phalanx.planner.stage_time import gemm_time

ROWS = Path(__file__).resolve().parents[1] / "phalanx" / "planner" / "serve" / "validation.json"


def source_name(row: dict) -> str:
    """The publication a row comes from (its `source` up to the first comma or parenthesis)."""
    return row["source"].split(",")[0].split(" (")[0]


def pool_of(row: dict) -> PoolRule:
    """The KV pool rule the row's engine ran with, as its source states it: TensorRT-LLM's
    share of the free memory (`kv_free_fraction`) and trtllm-bench's batch cap
    (`max_batch_limit`), else vLLM's rule (the planner's default)."""
    if "kv_free_fraction" not in row:
        return PoolRule()
    return PoolRule(fraction=row["kv_free_fraction"], of_free=True, max_batch=row.get("max_batch_limit", MAX_BATCH_LIMIT))


def costs_of(row: dict) -> ServeCosts:
    """The engine's framework costs: TensorRT-LLM's TensorRT engines under the C++ executor run
    no Python per request (no host time per sequence is published for them: none charged);
    every other engine here (TensorRT-LLM's PyTorch backend, SGLang) is driven from Python."""
    return GPU_CPP_EXECUTOR if "C++ executor" in row["engine"] else GPU_ENGINE


def predict(row: dict, models: dict, kv_dtype: str) -> tuple[float, str]:
    """(predicted metric, the decode step's largest cause); nan where no layout holds the run."""
    model = MODELS.get(row["model"]) or model_from_dict(models[row["model"]], source=row["model"])
    load = ServeLoad(isl=row["isl"], osl=row["osl"], concurrency=row.get("concurrency"), phase=row["phase"])
    fixed = parse_serve_fix(row["fix"])
    search = functools.partial(search_serving, model, CLUSTERS[row["cluster"]], load, gpus=row["gpus"],
                               weight_dtype=row["weight_dtype"], kv_dtype=row.get("kv_dtype", kv_dtype), keep=1,
                               pool=pool_of(row), costs=costs_of(row))
    result = search(fixed=fixed)
    if "trtllm-bench" in row["engine"] and "max_batch_tokens" not in fixed and result.ranked:
        # trtllm-bench's own token budget for the batch the KV pool holds (its tuning.py), not
        # the planner's choice among its budgets.
        plan = result.ranked[0]
        budget = trtllm_bench_max_num_tokens(plan.max_batch, isl=row["isl"], osl=row["osl"], pp=plan.layout.pp)
        result = search(fixed={**fixed, "max_batch_tokens": budget})
    if not result.ranked:
        return float("nan"), "refused"
    rates = result.ranked[0].rates
    cause = max(rates.breakdown, key=rates.breakdown.get) if rates.breakdown else ""
    value = {"output_tokens_per_s_total": rates.output_tps_gpu * row["gpus"],
             "output_tokens_per_s_per_gpu": rates.output_tps_gpu,
             "input_tokens_per_s_per_gpu": rates.input_tps_gpu}[row["metric"]]
    return value, cause


DEEPGEMM_DENSE = (
    (64, 2112, 7168, 206, 2.7), (64, 24576, 1536, 289, 1.7), (64, 32768, 512, 219, 1.8),
    (64, 7168, 16384, 336, 1.4), (64, 4096, 7168, 287, 1.4), (64, 7168, 2048, 295, 1.7),
    (128, 2112, 7168, 352, 2.4), (128, 24576, 1536, 535, 1.6), (128, 32768, 512, 358, 1.5),
    (128, 7168, 16384, 645, 1.4), (128, 4096, 7168, 533, 2.0), (128, 7168, 2048, 510, 1.7),
    (4096, 2112, 7168, 1058, 1.1), (4096, 24576, 1536, 990, 1.0), (4096, 32768, 512, 590, 1.0),
    (4096, 7168, 16384, 1358, 1.2), (4096, 4096, 7168, 1304, 1.1), (4096, 7168, 2048, 1025, 1.1))
"""(M, N, K, TFLOP/s, speedup) of every row of DeepGEMM's "Normal GEMMs for dense models" table
(deepseek-ai/DeepGEMM@7a70b43 README: fp8 with 128-wide block scales on an H800, whose SMs and
tensor cores are the H100's); speedup: over DeepSeek's "internally and carefully optimized
implementation based on CUTLASS 3.6", whose time is DeepGEMM's times the speedup."""


VLLM_LLAMA8B_QKV = (
    ("dgx-h100", "fp8", ((16, 87.46), (64, 396.96), (128, 693.31), (256, 956.00))),
    ("dgx-h100", "bf16", ((1, 2.513), (16, 39.11), (64, 160.59), (128, 307.85), (256, 544.33))),
    ("dgx-b200", "fp8", ((1, 8.451), (16, 137.11), (64, 533.22), (128, 905.74), (256, 1462.90), (512, 1759.88),
                         (1024, 2207.50))))
"""(cluster, dtype, ((M, TFLOP/s), ...)) of vLLM's benchmarks/kernels/bench_fp8_gemm.py on Llama 3.1
8B's fused qkv shape (N 6144, K 4096) as its pull requests print them: #17126 (H100: the
per-tensor fp8 CUTLASS GEMM without the activations' quantization, and torch's bf16 GEMM) and
#18778 (B200, the same fp8 column)."""


DEEPGEMM_GROUPED = (
    (4, 8192, 4096, 7168, 1297), (4, 8192, 7168, 2048, 1099), (8, 4096, 4096, 7168, 1288), (8, 4096, 7168, 2048, 1093),
    (1, 1024, 4096, 7168, 1233), (1, 1024, 7168, 2048, 925), (2, 512, 4096, 7168, 1040), (2, 512, 7168, 2048, 916),
    (4, 256, 4096, 7168, 932), (4, 256, 7168, 2048, 815))
"""(groups, M per group, N, K, TFLOP/s) of every row of DeepGEMM's "Grouped GEMMs for MoE models"
tables, contiguous layout then masked (deepseek-ai/DeepGEMM@7a70b43 README, fp8 on an H800): what
the routed experts' grouped GEMM (serve/step.gpu_gemm_time with moe_grouped) is checked on."""


CUBLASLT_FP4 = ((128, 2048, 7168, 338), (128, 24576, 1536, 745), (512, 2048, 7168, 1422), (512, 7168, 2048, 1190),
                (1024, 7168, 2048, 1399), (4096, 4096, 7168, 3939), (8192, 8192, 8192, 5239))
"""(M, N, K, TFLOP/s) of cuBLASLt's FP4 x FP4 (MXFP4) GEMMs on a B200, every row of DeepGEMM pull
request 348's table (its cublasTest 13.3 column); the first four set the fp4 fill
(serve/costs.GPU_FP4_FILL_S)."""


def training_gemm_time(cluster_name: str, dtype: str, m: float, n: float, k: float) -> float:
    """What the serving step charged one GEMM before issue 39 took gpu_gemm_time: the weights'
    bytes or the training planner's GEMM time (f(m) f(n) f(k) and the large tiles' waves at
    every size), whichever is longer, plus one launch's fill."""
    cluster = CLUSTERS[cluster_name]
    peak = gemm_peak(cluster, dtype, 1)
    read = n * k * WEIGHT_BYTES[dtype] / cluster.memory_bw_per_rank(1)
    return max(read, gemm_time(m, n, k, cluster=cluster, peak=peak)) + GPU_ENGINE.gemm_fill(dtype)


def print_kernels() -> None:
    """The step model's time of one GEMM (serve/step.one_gemm_time: the kernel's roofline and
    one launch's fill) against published kernel timings: DeepGEMM's dense fp8 table on an
    H800 and its CUTLASS 3.6 baseline, and vLLM's per-tensor fp8 and bf16 GEMMs on H100 and B200."""
    print(f"{'cluster':<9} {'dtype':<5} {'M':>5} {'N':>6} {'K':>6} {'model us':>9} {'published us':>13} {'model/published':>16}"
          f" {'training GEMM/published':>24}  (DeepGEMM's CUTLASS 3.6 baseline: us, model/baseline)")
    ratios: dict[str, list[float]] = {"DeepGEMM": [], "its CUTLASS 3.6 baseline": [], "vLLM": [], "cuBLASLt fp4": []}
    training: dict[str, list[float]] = {"DeepGEMM": [], "its CUTLASS 3.6 baseline": [], "vLLM": [], "cuBLASLt fp4": []}
    for m, n, k, tflops, speedup in DEEPGEMM_DENSE:
        model = one_gemm_time(CLUSTERS["hgx-h800"], "fp8", m, n, k, costs=GPU_ENGINE)
        old = training_gemm_time("hgx-h800", "fp8", m, n, k)
        deep = 2 * m * n * k / (tflops * 1e12)
        ratios["DeepGEMM"].append(model / deep)
        ratios["its CUTLASS 3.6 baseline"].append(model / (deep * speedup))
        training["DeepGEMM"].append(old / deep)
        training["its CUTLASS 3.6 baseline"].append(old / (deep * speedup))
        print(f"{'hgx-h800':<9} {'fp8':<5} {m:>5} {n:>6} {k:>6} {model * 1e6:>9.1f} {deep * 1e6:>13.1f} "
              f"{model / deep:>16.2f} {old / deep:>24.2f}  ({deep * speedup * 1e6:.1f}, {model / (deep * speedup):.2f})")
    n, k = 6144, 4096
    for cluster, dtype, points in VLLM_LLAMA8B_QKV:
        for m, tflops in points:
            model = one_gemm_time(CLUSTERS[cluster], dtype, m, n, k, costs=GPU_ENGINE)
            old = training_gemm_time(cluster, dtype, m, n, k)
            published = 2 * m * n * k / (tflops * 1e12)
            ratios["vLLM"].append(model / published)
            training["vLLM"].append(old / published)
            print(f"{cluster:<9} {dtype:<5} {m:>5} {n:>6} {k:>6} {model * 1e6:>9.1f} {published * 1e6:>13.1f} "
                  f"{model / published:>16.2f} {old / published:>24.2f}")
    grouped: dict[str, list[float]] = {"charged f(rows)": [], "uncharged": []}
    h800 = CLUSTERS["hgx-h800"]
    peak, bw = gemm_peak(h800, "fp8", 1), h800.memory_bw_per_rank(1)
    for groups, m, n, k, tflops in DEEPGEMM_GROUPED:
        model = gpu_gemm_time(h800, peak, bw, groups, m, n, k, 1.0, moe_grouped=True) + GPU_ENGINE.gemm_fill("fp8")
        flat = gpu_gemm_time(h800, peak, bw, groups, m, n, k, 1.0) + GPU_ENGINE.gemm_fill("fp8")
        published = 2 * groups * m * n * k / (tflops * 1e12)
        grouped["charged f(rows)"].append(model / published)
        grouped["uncharged"].append(flat / published)
        print(f"{'hgx-h800':<9} {'fp8':<5} {f'{groups}x{m}':>5} {n:>6} {k:>6} {model * 1e6:>9.1f} {published * 1e6:>13.1f} "
              f"{model / published:>16.2f}   (grouped; rows per group not charged: {flat / published:.2f})")
    for m, n, k, tflops in CUBLASLT_FP4:
        model = one_gemm_time(CLUSTERS["dgx-b200"], "fp4", m, n, k, costs=GPU_ENGINE)
        old = training_gemm_time("dgx-b200", "fp4", m, n, k)
        published = 2 * m * n * k / (tflops * 1e12)
        ratios["cuBLASLt fp4"].append(model / published)
        training["cuBLASLt fp4"].append(old / published)
        print(f"{'dgx-b200':<9} {'fp4':<5} {m:>5} {n:>6} {k:>6} {model * 1e6:>9.1f} {published * 1e6:>13.1f} "
              f"{model / published:>16.2f} {old / published:>24.2f}")
    for name, values in grouped.items():
        print(f"model / DeepGEMM grouped ({name}): median {statistics.median(values):.2f} "
              f"({min(values):.2f} to {max(values):.2f}) over {len(values)} grouped GEMMs")
    for name, values in ratios.items():
        print(f"model / {name}: median {statistics.median(values):.2f} ({min(values):.2f} to {max(values):.2f}) "
              f"over {len(values)} GEMMs; the training GEMM's: median {statistics.median(training[name]):.2f} "
              f"({min(training[name]):.2f} to {max(training[name]):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-dtype", default="fp8", choices=("bf16", "fp8"),
                        help="KV cache dtype of rows that do not state one (default fp8, chosen on the visible half)")
    parser.add_argument("--split", choices=("visible", "holdout", "both"), default="both",
                        help="which half's rows and summary to print (modelling work looks at 'visible' only)")
    parser.add_argument("--worst", type=int, default=0, help="also list the N rows of each half furthest off")
    parser.add_argument("--quiet", action="store_true", help="no per-row lines")
    parser.add_argument("--first", type=int, default=None,
                        help="only the file's first N rows (27: the rows of issue 23, before issue 39 added more)")
    parser.add_argument("--by-group", action="store_true",
                        help="also the median pred/pub of each model on each cluster and dtype, per half")
    parser.add_argument("--kernels", action="store_true",
                        help="only the step model's fp8 GEMM times against DeepGEMM's published table and its CUTLASS baseline")
    args = parser.parse_args()
    if args.kernels:
        print_kernels()
        return
    data = json.loads(ROWS.read_text())
    start = time.perf_counter()
    splits = ("visible", "holdout") if args.split == "both" else (args.split,)
    done: dict[str, list[tuple[float, dict, float, str]]] = {s: [] for s in splits}
    if not args.quiet:
        print(f"{'row':>22} {'split':>8}  {'what':<44} {'isl/osl':>11} {'predicted':>10} {'published':>10} {'pred/pub':>8}")
    for row in data["rows"][:args.first]:
        if row["split"] not in splits:
            continue
        got, cause = predict(row, data["models"], args.kv_dtype)
        ratio = got / row["measured"]
        done[row["split"]].append((abs(ratio - 1), row, ratio, cause))
        if not args.quiet:
            print(f"{row['id']:>22} {row['split']:>8}  {row['what'][:44]:<44} {row['isl']:>5}/{row['osl']:<5} "
                  f"{got:>10,.0f} {row['measured']:>10,.0f} {ratio:>8.2f}")
    for split, rows in done.items():
        errs = [e for e, *_ in rows if not math.isnan(e)]
        refused = len(rows) - len(errs)
        print(f"{split}: {len(rows)} rows, median |error| {statistics.median(errs):.1%} (target 15%), "
              f"within 15%: {sum(e <= 0.15 for e in errs)}, refused: {refused}")
        by_source: dict[str, list[float]] = {}
        for err, row, _, _ in rows:
            by_source.setdefault(source_name(row), []).append(err)
        for source, source_errs in sorted(by_source.items()):
            print(f"    {source[:60]:<60} {len(source_errs):>4} rows, median |error| {statistics.median(source_errs):.1%}")
        if args.by_group:
            groups: dict[str, list[float]] = {}
            for _, row, ratio, _ in rows:
                groups.setdefault(f"{row['model']} {row['weight_dtype']} on {row['cluster']}", []).append(ratio)
            for group, ratios in sorted(groups.items()):
                print(f"    {group:<40} {len(ratios):>3} rows, median pred/pub {statistics.median(ratios):.2f} "
                      f"({min(ratios):.2f} to {max(ratios):.2f})")
        for err, row, ratio, cause in sorted(rows, key=lambda r: -r[0] if not math.isnan(r[0]) else -math.inf)[:args.worst]:
            print(f"    worst: {row['id']:<22} {row['what'][:50]:<50} {row['isl']:>5}/{row['osl']:<5} pred/pub "
                  f"{ratio:.2f}, step mostly {cause}")
    fills = ", ".join(f"{x * 1e6:.2f}" for x in kernel_fill_seconds())
    print(f"GPU engines: host work overlapped with the GPU's (CUDA graphs); a GEMM's fill and drain {GPU_KERNEL_FILL_S * 1e6:.2f} us "
          f"per launch (the median of DeepGEMM's decode-size fp8 GEMMs on H800: {fills} us beyond their bytes), "
          f"an NVFP4 one's {GPU_FP4_FILL_S * 1e6:.2f} us (cuBLASLt's fp4 GEMMs of 128 and 512 rows on B200: "
          f"{', '.join(f'{x * 1e6:.2f}' for x in fp4_fill_seconds())} us); element-wise passes at the streaming bandwidth; "
          f"grouped-query decode attention's KV reads at {DECODE_ATTENTION_HBM_FRACTION:.3f} of the datasheet bandwidth "
          f"(TensorRT-LLM's XQA on Hopper 0.60-0.75, FlashInfer pull request 4904; trtllm-gen on B200 0.61 and 0.73, "
          f"its pull request 1415)")
    print(f"Python-driven engines: a step at least {TORCH_SAMPLER_HOST_S * 1e6:.1f} us of host work per sequence "
          f"(TensorRT-LLM's TorchSampler at a batch of 1,000, its pull request 11983), x{CLUSTERS['gb200-nvl72'].host_cpu_slowdown:.2f} "
          f"on GB200's Grace (TransformerEngine issue 2053); none under the C++ executor")
    print(f"({time.perf_counter() - start:.2f} s; KV dtype where a row states none: {args.kv_dtype})")


if __name__ == "__main__":
    main()
