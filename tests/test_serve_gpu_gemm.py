"""The serving step's GEMM on a GPU (serve/step.gpu_gemm_time, issue 39): a roofline of the
kernel's bytes and FLOPs, with no charge for few rows (decode-size kernels stream their
weights, as DeepGEMM's and vLLM's published kernel timings show) and the large tiles' wave
loss only once they fill a wave; the CPU keeps the training planner's calibrated GEMM."""

from __future__ import annotations

import dataclasses
import math

import pytest

from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.serve.costs import GPU_ENGINE
from phalanx.planner.serve.step import ServeLayout, _linear, gemm_peak, gpu_gemm_time
from phalanx.planner.stage_time import gemm_time

H100 = CLUSTERS["dgx-h100"]
BW = 3.35e12 * 0.9
FP8_PEAK = 1979e12


def test_decode_size_gemm_streams_its_bytes():
    """64 rows of Llama 8B's qkv (6144 x 4096) in fp8: weights 25.2 MB, inputs 64 x 4096
    bytes, bf16 outputs 64 x 6144 x 2, all at the streaming bandwidth; its FLOPs at 0.7 x
    f(6144) f(4096) of 1,979 TFLOP/s take far less, and few rows are not charged."""
    n, k, m = 6144, 4096, 64
    t = gpu_gemm_time(H100, gemm_peak(H100, "fp8", 1), BW, 1, m, n, k, 1.0)
    assert t == pytest.approx((n * k + m * k + 2 * m * n) / BW)
    assert t < 0.6 * max(n * k / BW, gemm_time(m, n, k, cluster=H100, peak=FP8_PEAK))  # the training GEMM: 16.6 us


def test_large_gemm_pays_efficiency_and_last_wave():
    """4096 x 4096 x 7168 fp8: 32 x 16 = 512 tiles of 128 x 256 (or 16 x 32 transposed) on
    132 SMs run in 4 waves of which the last is 116 / 132 full (512 / 528); FLOPs at
    0.7 x f(4096) f(7168) x 512 / 528 of the fp8 peak."""
    m, n, k = 4096, 4096, 7168
    half = H100.matmul_half_dim
    eff = 0.7 * n / (n + half) * k / (k + half) * 512 / 528
    t = gpu_gemm_time(H100, FP8_PEAK, BW, 1, m, n, k, 1.0)
    assert t == pytest.approx(2 * m * n * k / (FP8_PEAK * eff))


def test_grouped_gemm_tiles_fill_waves_together():
    """8 experts of 256 rows each (7168 x 2048): 8 x 2 x 28 = 448 tiles fill the waves; the
    same rows in one group of 256 have 56 tiles, fewer than the SMs, and no wave charge."""
    n, k = 7168, 2048
    one = gpu_gemm_time(H100, FP8_PEAK, BW, 1, 256, n, k, 1.0)
    eight = gpu_gemm_time(H100, FP8_PEAK, BW, 8, 256, n, k, 1.0)
    tiles = 8 * 2 * 28
    wave = tiles / (math.ceil(tiles / 132) * 132)
    half = H100.matmul_half_dim
    assert eight == pytest.approx(max(8 * (n * k + 256 * k + 2 * 256 * n) / BW,
                                      2 * 8 * 256 * n * k / (FP8_PEAK * 0.7 * n / (n + half) * k / (k + half) * wave)))
    assert one < eight / 4


def test_cpu_keeps_the_training_gemm():
    """sm_count 0 (this CPU, whose GEMM rate calibration measures): the roofline of the weights
    and the training planner's gemm_time, as before."""
    cpu = dataclasses.replace(CLUSTERS["local"], sm_count=0)
    peak, bw = 1e12, 1e10
    got = _linear(cpu, peak, bw, 64, [(512, 512)], 4.0)
    assert got == max(512 * 512 * 4 / bw, gemm_time(64, 512, 512, cluster=cpu, peak=peak))


def test_fp4_gemms_pay_their_own_fill():
    """An NVFP4 step's 129 GEMM launches (Llama 3 8B) each fill and drain for
    ServeCosts.gemm_fp4_s (9.48 us: cuBLASLt's fp4 GEMMs of 128 and 512 rows on B200, 8.9 to
    10.4 us beyond their bytes), an fp8 step's for gemm_s; 0 falls back to gemm_s."""
    from phalanx.model.config import PRESETS as MODELS
    from phalanx.planner.serve.costs import GPU_ENGINE, GPU_FP4_FILL_S, fp4_fill_seconds
    from phalanx.planner.serve.step import ServeLayout, step_time

    assert GPU_FP4_FILL_S == pytest.approx(9.48e-6, abs=0.01e-6) and len(fp4_fill_seconds()) == 4
    b200, model = CLUSTERS["dgx-b200"], MODELS["llama3-8b"]
    for dtype, fill in (("fp4", GPU_ENGINE.gemm_fp4_s), ("fp8", GPU_ENGINE.gemm_s)):
        layout = ServeLayout(weight_dtype=dtype, kv_dtype="fp8")
        with_fill = step_time(model, b200, layout, decodes=64, context=1000, costs=GPU_ENGINE).breakdown
        none = dataclasses.replace(GPU_ENGINE, gemm_s=0.0, gemm_fp4_s=0.0)
        without = step_time(model, b200, layout, decodes=64, context=1000, costs=none).breakdown
        assert with_fill["weights_and_gemms"] - without["weights_and_gemms"] == pytest.approx(129 * fill)
    assert dataclasses.replace(GPU_ENGINE, gemm_fp4_s=0.0).gemm_fill("fp4") == GPU_ENGINE.gemm_s


def test_moe_grouped_gemm_charges_its_rows_per_group():
    """An MoE layer's grouped GEMM also pays f(rows per group) on its FLOPs (DeepGEMM's grouped
    tables: 932 TFLOP/s at 256 rows per group where 1,024 rows reach 1,233): 4 groups of 256
    rows of 4096 x 7168 on an H800 by hand, compute-bound, its 4 x 2 x 16 = 128 tiles under one
    wave of 132 SMs; the same call without the flag, as a dense GEMM, does not pay it."""
    h800 = CLUSTERS["hgx-h800"]
    peak, bw = gemm_peak(h800, "fp8", 1), h800.memory_bw_per_rank(1)
    m, n, k = 256, 4096, 7168
    half = h800.matmul_half_dim
    base = 0.7 * n / (n + half) * k / (k + half)
    flops = 2 * 4 * m * n * k
    charged = gpu_gemm_time(h800, peak, bw, 4, m, n, k, 1.0, moe_grouped=True)
    flat = gpu_gemm_time(h800, peak, bw, 4, m, n, k, 1.0)
    assert flat == pytest.approx(flops / (peak * base))
    assert charged == pytest.approx(flops / (peak * base * m / (m + half)))


def test_step_routes_experts_through_the_charged_grouped_gemm():
    """Mixtral 8x7B at tp=8 with 3,000 decodes on an H200: about 750 rows per expert, so the
    routed experts cost more than the uncharged grouped GEMM gives; attention and dense layers
    (none in Mixtral) are untouched (the host floor's excess over the step shrinks with it)."""
    # Imported when run, not at the top: the test swaps the module's gpu_gemm_time for a while.
    import phalanx.planner.serve.step as step_mod
    model, cluster = MODELS["mixtral-8x7b"], CLUSTERS["dgx-h200"]
    layout = ServeLayout(tp=8, weight_dtype="fp8", kv_dtype="fp8")
    real = step_mod.step_time(model, cluster, layout, decodes=3000, context=1000, costs=GPU_ENGINE)
    original = step_mod.gpu_gemm_time
    try:
        step_mod.gpu_gemm_time = lambda *a, moe_grouped=False, **kw: original(*a, **kw)
        flat = step_mod.step_time(model, cluster, layout, decodes=3000, context=1000, costs=GPU_ENGINE)
    finally:
        step_mod.gpu_gemm_time = original
    assert real.breakdown["weights_and_gemms"] > flat.breakdown["weights_and_gemms"] * 1.05
    assert {k: v for k, v in real.breakdown.items() if k not in ("weights_and_gemms", "host")} == \
        {k: v for k, v in flat.breakdown.items() if k not in ("weights_and_gemms", "host")}
