"""Activation and state memory against published formulas, and pruning by memory."""

import pytest

from phalanx.errors import UserError
from phalanx.model.config import ModelConfig, model_config
from phalanx.planner.cost import evaluate
from phalanx.planner.hardware import PRESETS, Cluster
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.memory import layer_activation_bytes
from phalanx.planner.search import auto_plan, search

# MHA + 4h GeLU, the model of Korthikanti et al.: s=2048, b=2, h=4096, a=32.
GPT = ModelConfig(name="gpt", vocab_size=50000, dim=4096, n_layers=8, n_heads=32, n_kv_heads=32,
                  ffn_dim=16384, mlp="gelu")
S, B, H, A = 2048, 2, 4096, 32


def act(**kw):
    base = dict(seq=S, mbs=B, tp=1, sp=False, recompute="none", moe=False, flash=False)
    return layer_activation_bytes(GPT, **{**base, **kw})


def test_activation_formulas_of_the_reference():
    sbh = S * B * H
    assert act() == pytest.approx(sbh * (34 + 5 * A * S / H))
    t = 4
    assert act(tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * A * S / (H * t)))
    assert act(tp=t, sp=True) == pytest.approx(sbh * (34 / t + 5 * A * S / (H * t)))
    assert act(tp=t, sp=True, recompute="selective") == pytest.approx(34 * sbh / t)
    assert act(recompute="full") == pytest.approx(2 * sbh)
    # Flash attention stores no s x s matrix: the selective figure without recomputing.
    assert act(tp=t, sp=True, flash=True) == pytest.approx(34 * sbh / t)
    # SP that keeps the gathered attention and MLP inputs (2 sbh each) whole instead of
    # gathering them again in backward: 30 sbh / t + 4 sbh.
    assert act(tp=t, sp=True, flash=True, sp_regather=False) == pytest.approx(30 * sbh / t + 4 * sbh)


def test_memory_of_a_hand_computed_layout():
    # pp=1, tp=1, dp=2, zero=0: every parameter at 18 bytes; activations of 8 layers of one
    # micro-batch (flash: 34 sbh each) plus one micro-batch of logits at 6 bytes.
    work = Workload(global_batch=4, seq_len=S)
    est = evaluate(GPT, PRESETS["dgx-h100"], work, Layout(dp=2, mbs=2, microbatches=1))
    params = 8 * (4 * H * H + 2 * H * 16384 + 2 * H) + 2 * 50000 * H
    assert est.memory_breakdown["model_state"] == pytest.approx(18 * params)
    assert est.memory_breakdown["activations"] == pytest.approx(8 * 34 * S * B * H)
    assert est.memory_breakdown["logits"] == pytest.approx(S * B * 50000 * 6)


def test_search_prunes_what_does_not_fit():
    small = Cluster(name="small", memory_gib=24.0, memory_reserved_gib=2.0)
    work = Workload(global_batch=64, seq_len=4096)
    model = model_config("llama3-8b")
    result = search(model, small, work, world_size=8)
    assert result.pruned_memory > 0 and result.ranked
    assert all(e.memory_bytes <= small.usable_bytes for e in result.ranked)
    # 8B with replicated Adam state (18 B/param = 135 GiB) cannot fit unsharded on one 24 GiB GPU.
    assert all(e.layout.zero == 3 or e.layout.tp * e.layout.pp > 1 for e in result.ranked)


def test_auto_plan_says_when_nothing_fits():
    tiny_gpu = Cluster(name="tiny", memory_gib=2.0, memory_reserved_gib=1.0)
    with pytest.raises(UserError, match="fits in 1.0 GiB"):
        auto_plan(model_config("llama3-70b"), world_size=2, global_batch=8, seq_len=4096, cluster=tiny_gpu)
