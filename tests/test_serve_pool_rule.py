"""How an engine sizes its KV pool (serve_memory.PoolRule): vLLM's share of the device, the
planner's default, or TensorRT-LLM's share of the memory the weights leave free, with its
batch cap. Hand-computed on a preset."""

from __future__ import annotations

import pytest

from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.serve_memory import PoolRule, max_batch_for, rank_memory
from phalanx.planner.serve_step import ServeLayout


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
