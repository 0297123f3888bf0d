"""A GPU's grouped-query decode attention streams the KV cache at the share of the datasheet
bandwidth that TensorRT-LLM's decode kernels are published at (serve/step.
DECODE_ATTENTION_HBM_FRACTION, 0.675), not the plain streaming rate the weights' GEMMs get
(0.9); latent attention (FlashMLA's own 0.9) and the CPU's calibrated rate keep theirs
(issue 39). Hand-computed on presets."""

from __future__ import annotations

import pytest

from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.serve.costs import CPU_GUESS, GPU_ENGINE
from phalanx.planner.serve.step import DECODE_ATTENTION_HBM_FRACTION, ServeLayout, step_time


def test_fraction_is_the_middle_of_the_published_range():
    assert DECODE_ATTENTION_HBM_FRACTION == pytest.approx(0.675)


def test_gqa_decode_attention_on_h100_by_hand():
    """Llama 3 8B, fp8 KV cache, one H100: 256 sequences of 1,500 positions read 32 layers x
    8 KV heads x 128 x (K and V) bytes each, at 0.675 of 3.35 TB/s."""
    model, cluster = MODELS["llama3-8b"], CLUSTERS["dgx-h100"]
    layout = ServeLayout(weight_dtype="fp8", kv_dtype="fp8")
    step = step_time(model, cluster, layout, decodes=256, context=1500, costs=GPU_ENGINE)
    kv_bytes = 256 * 1500 * 32 * 8 * 128 * 2
    assert step.breakdown["attention_decode"] == pytest.approx(kv_bytes / (3.35e12 * 0.675))


def test_tp_splits_the_kv_heads_read():
    """tp=2 holds 4 of the 8 KV heads per rank: half the bytes, at the same rate."""
    model, cluster = MODELS["llama3-8b"], CLUSTERS["dgx-h100"]
    one = step_time(model, cluster, ServeLayout(weight_dtype="fp8", kv_dtype="fp8"), decodes=64, context=4000,
                    costs=GPU_ENGINE)
    two = step_time(model, cluster, ServeLayout(tp=2, weight_dtype="fp8", kv_dtype="fp8"), decodes=64, context=4000,
                    costs=GPU_ENGINE)
    assert two.breakdown["attention_decode"] == pytest.approx(one.breakdown["attention_decode"] / 2)


def test_latent_attention_keeps_the_streaming_rate():
    """DeepSeek-V3's latent (512 + 64 values per position and layer, bf16), 61 layers, whole on
    each rank: FlashMLA's published 0.9 of the bandwidth (the presets' `hbm_efficiency`), unless
    its FLOPs at the attention rate take longer."""
    model, cluster = MODELS["deepseek-v3"], CLUSTERS["dgx-h100"]
    layout = ServeLayout(dp=8, ep=8, weight_dtype="fp8", kv_dtype="bf16")
    step = step_time(model, cluster, layout, decodes=32, context=2000, costs=GPU_ENGINE)
    read = 32 * 2000 * 61 * (512 + 64) * 2 / (3.35e12 * 0.9)
    flops = 61 * 2 * 32 * 2000 * 128 * (512 + 64 + 512) / (989e12 * cluster.attention_efficiency)
    assert step.breakdown["attention_decode"] == pytest.approx(max(read, flops))


def test_cpu_reads_the_cache_at_its_calibrated_rate():
    """The CPU (no SMs) keeps the bandwidth its calibration measured for every read."""
    model, cluster = MODELS["llama3-8b"], CLUSTERS["local"]
    assert cluster.sm_count == 0
    layout = ServeLayout(weight_dtype="fp32", kv_dtype="fp32")
    step = step_time(model, cluster, layout, decodes=4, context=100, costs=CPU_GUESS)
    kv_bytes = 4 * 100 * 32 * 8 * 128 * 2 * 4
    bw = cluster.memory_bw_per_rank(1)
    flops = 32 * 2 * 4 * 100 * 32 * 256 / (cluster.peak_flops_per_rank(1) * cluster.attention_efficiency)
    assert step.breakdown["attention_decode"] == pytest.approx(max(kv_bytes / bw, flops))
