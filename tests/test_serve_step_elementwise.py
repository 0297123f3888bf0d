"""Two pieces of physics the serving step and the published-run benchmark take from outside
the planner (issue 39): a GPU step's element-wise passes, charged as the training planner
charges a forward's (its activations read and written once at the streaming bandwidth), and
trtllm-bench's own token budget per step (its tuning.py). Hand-computed on presets."""

from __future__ import annotations

import dataclasses

import pytest

from phalanx.errors import UserError
from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.serve.costs import CPU_GUESS, GPU_ENGINE, ServeCosts, load_serve_costs
from phalanx.planner.serve.memory import trtllm_bench_max_num_tokens
from phalanx.planner.serve.step import ServeLayout, activation_bytes_per_token, step_time


def test_llama_8b_elementwise_bytes_by_hand():
    """Llama 3 8B (dim 4096, 8 KV heads of 128, SwiGLU of 14336), one token, tp=1, without
    sequence parallelism: norm and block inputs 4 + 2 + 2 bytes per dim, q and the output
    projection's input 2 + 2, k and v 4 x 1024, SwiGLU 8 x 14336; tp=2 splits all but the first."""
    model = MODELS["llama3-8b"]
    h, kv, f = 4096, 8 * 128, 14336
    replicated = 8 * h
    split = 4 * h + 4 * kv + 8 * f
    dense, moe = activation_bytes_per_token(model, 1)
    assert dense == replicated + split and moe == 0.0
    assert activation_bytes_per_token(model, 2)[0] == replicated + split / 2


def test_gpu_step_pays_elementwise_passes_cpu_does_not():
    """On an H100 the step's `elementwise` cause is 2 x tokens x layers x bytes per token at the
    streaming bandwidth (3.35 TB/s x 0.9), and the rest of the step is unchanged to the bit; the
    CPU's costs leave it at 0 (calibration's per-token cost holds it there)."""
    model, cluster = MODELS["llama3-8b"], CLUSTERS["dgx-h100"]
    layout = ServeLayout(weight_dtype="fp8", kv_dtype="fp8")
    on = step_time(model, cluster, layout, decodes=256, context=1500, prefill_tokens=256, costs=GPU_ENGINE)
    off = step_time(model, cluster, layout, decodes=256, context=1500, prefill_tokens=256,
                    costs=dataclasses.replace(GPU_ENGINE, elementwise_passes=False))
    dense, _ = activation_bytes_per_token(model, 1)
    expected = 2 * 512 * 32 * dense / (3.35e12 * 0.9)
    assert on.breakdown["elementwise"] == pytest.approx(expected)
    assert off.breakdown["elementwise"] == 0.0
    assert {k: v for k, v in on.breakdown.items() if k not in ("elementwise", "host")} == \
        {k: v for k, v in off.breakdown.items() if k not in ("elementwise", "host")}
    assert not CPU_GUESS.elementwise_passes and not ServeCosts().elementwise_passes


def test_moe_layers_count_their_routed_rows():
    """Mixtral 8x7B routes each token to 2 experts: an MoE layer's element-wise bytes per token
    are the attention's plus the k routed copies of the rows in and out and their SwiGLU
    tensors."""
    model = MODELS["mixtral-8x7b"]
    _, moe = activation_bytes_per_token(model, 1)
    h, k, f = model.dim, model.experts_per_token, model.moe_ffn_dim
    no_ffn = 8 * h + 4 * h + 4 * model.n_kv_heads * model.head_dim
    assert moe == pytest.approx(no_ffn + 2 * k * h + 8 * k * f + 2 * k * h)
    # tp=2: each rank runs half of every expert on every routed row, so the rows stay whole
    # while the attention tensors and the SwiGLU's halve.
    _, moe2 = activation_bytes_per_token(model, 2)
    assert moe2 == pytest.approx(8 * h + (4 * h + 4 * model.n_kv_heads * model.head_dim + 8 * k * f) / 2 + 4 * k * h)


def test_calibration_file_flag_must_be_boolean(tmp_path):
    path = tmp_path / "serve-local.json"
    path.write_text('{"elementwise_passes": 1}')
    with pytest.raises(UserError, match="elementwise_passes must be true or false"):
        load_serve_costs(path)


@pytest.mark.parametrize(("requests", "isl", "osl", "pp", "budget"), [
    (3000, 1000, 1000, 1, 6144),     # 3000 x 2 = 6,000: to 512s, 12 x 512
    (2000, 1000, 1000, 1, 4096),     # 4,000: to 256s, 16 x 256
    (200, 128, 2048, 1, 2048),       # 212.5: at least 2,048
    (500, 2048, 128, 1, 9216),       # 500 x 17 = 8,500: to 1,024s, 9 x 1,024
    (5000, 20000, 2000, 1, 32768),   # 4,096 (the batch cap) x 11, at most 32,768
    (1000, 1000, 1000, 2, 2048),     # 1,000 / 2 stages x 2 = 1,000: at least 2,048
])
def test_trtllm_bench_budget_by_hand(requests, isl, osl, pp, budget):
    assert trtllm_bench_max_num_tokens(requests, isl=isl, osl=osl, pp=pp) == budget
