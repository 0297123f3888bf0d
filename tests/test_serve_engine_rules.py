"""What the planner takes from a serving engine's own rules: how it sizes its KV pool
(serve_memory.PoolRule: vLLM's share of the device, the planner's default, or TensorRT-LLM's
share of the memory the weights leave free, with its batch cap) and what each GEMM it launches
costs beyond its bytes (ServeCosts.gemm_s). Hand-computed on presets."""

from __future__ import annotations

import pytest

from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.serve.memory import PoolRule, max_batch_for, rank_memory
from phalanx.planner.serve.step import ServeLayout


def test_free_memory_share_and_device_share():
    """Llama 3 70B fp8 on one H100: vLLM's pool is 0.9 x 80 GiB less weights and workspace
    (capped by the 76 GiB the reserve leaves); TensorRT-LLM's is 0.95 of the 76 GiB less the
    same. With 70 GB of weights the second is the larger: it shares out what is free, not the
    device."""
    model, cluster = MODELS["llama3-70b"], CLUSTERS["dgx-h100"]
    layout = ServeLayout(weight_dtype="fp8", kv_dtype="fp8")
    vllm = rank_memory(model, cluster, layout, max_batch_tokens=2048)
    trt = rank_memory(model, cluster, layout, max_batch_tokens=2048, pool=PoolRule(fraction=0.95, of_free=True))
    gib = 2**30
    left = 76 * gib - vllm.weights - vllm.workspace
    assert vllm.kv_pool == pytest.approx(min(72 * gib, 76 * gib) - vllm.weights - vllm.workspace)
    assert trt.kv_pool == pytest.approx(0.95 * left)
    assert trt.kv_pool > vllm.kv_pool


def test_batch_cap_is_the_rules():
    """An 8B model's pool on an H200 holds more than 1,024 short sequences: vLLM's rule caps
    the batch at 1,024, trtllm-bench's at 4,096."""
    model, cluster = MODELS["llama3-8b"], CLUSTERS["dgx-h200"]
    layout = ServeLayout(weight_dtype="fp8", kv_dtype="fp8")
    mem = rank_memory(model, cluster, layout, max_batch_tokens=2048)
    assert max_batch_for(mem, isl=128, osl=128) == 1024
    capped = max_batch_for(mem, isl=128, osl=128, limit=4096)
    assert 1024 < capped <= 4096 and capped == min(4096, mem.kv_tokens // 256)


def test_each_gemm_launch_pays_its_fill():
    """ServeCosts.gemm_s per GEMM launched: Llama 3 8B launches 2 attention GEMMs (fused qkv,
    output) and 2 feed-forward ones (fused gate and up, down) in each of 32 layers, plus the
    head: 129. DeepSeek-V3: 5 attention GEMMs in 61 layers, 2 dense feed-forward ones in 3,
    router + shared expert (2) + routed experts (2 grouped) in 58, the head: 305 + 6 + 290 + 1."""
    import dataclasses

    from phalanx.planner.hardware import PRESETS as CLUSTERS
    from phalanx.planner.serve.costs import GPU_ENGINE, GPU_KERNEL_FILL_S, kernel_fill_seconds
    from phalanx.planner.serve.step import step_time

    cluster = CLUSTERS["dgx-h100"]
    for name, layout, launches in (("llama3-8b", ServeLayout(weight_dtype="fp8"), 129),
                                   ("deepseek-v3", ServeLayout(dp=8, ep=8, weight_dtype="fp8"), 602)):
        none = dataclasses.replace(GPU_ENGINE, gemm_s=0.0)
        one_ms = dataclasses.replace(GPU_ENGINE, gemm_s=1e-3)
        a = step_time(MODELS[name], cluster, layout, decodes=64, context=1000, costs=none).seconds
        b = step_time(MODELS[name], cluster, layout, decodes=64, context=1000, costs=one_ms).seconds
        assert b - a == pytest.approx(launches * 1e-3, rel=1e-9), name
    # The GPU figure is the median of the twelve published GEMMs' time beyond their bytes.
    fills = sorted(kernel_fill_seconds())
    assert GPU_KERNEL_FILL_S == pytest.approx((fills[5] + fills[6]) / 2) and 1e-6 < GPU_KERNEL_FILL_S < 1e-5
