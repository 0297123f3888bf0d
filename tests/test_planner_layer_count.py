"""Planning does not grow with the declared layer count (issue 25): the planner counts dense and
MoE layers in closed form instead of visiting each, and times deep pipelines from shallower ones.

Each closed form is checked against the per-layer sum it replaces (exact: integer counts, or
floating sums of identical terms, 1e-12 relative); a model of 10^12 layers plans; the deep
pipeline bubble is checked against the full timeline. Timing lives in benchmarks/planner_speed.py.
"""

from __future__ import annotations

import json
import random

import pytest

from phalanx.model.config import PRESETS, ModelConfig
from phalanx import cli
from phalanx.planner.cost import layer_flops, step_flops
from phalanx.planner.layout import Workload
from phalanx.planner.memory import param_counts, total_params
from phalanx.planner.pipeline_orders import _timed_bubble, v_bubble

TRILLION = {"n_layers": 10**12, "dim": 8, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 4, "vocab_size": 256,
            "n_experts": 2, "experts_per_token": 2, "n_dense_layers": 3, "moe_every": 2,
            "dense_layers": [5, 7, 10**12 - 1]}
"""Small layers (about 4e14 parameters, under ModelConfig's 1e15) with every MoE-layer rule."""


def _moe_layers_one_by_one(cfg: ModelConfig) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))


def test_moe_layer_count_in_closed_form_equals_counting_each_layer():
    rng = random.Random(0)
    configs = list(PRESETS.values())
    for _ in range(300):
        layers = rng.randint(1, 60)
        configs.append(ModelConfig(n_layers=layers, n_experts=rng.choice([0, 4]), n_dense_layers=rng.randint(0, 70),
                                   moe_every=rng.randint(1, 5),
                                   dense_layers=tuple(rng.sample(range(-3, 70), rng.randint(0, 6)))))
    for cfg in configs:
        assert cfg.n_moe_layers == _moe_layers_one_by_one(cfg), cfg


def test_flops_and_parameters_equal_the_per_layer_sums_for_presets():
    work = Workload(global_batch=4, seq_len=4096)
    for cfg in PRESETS.values():
        gemm = attn = 0.0
        for i in range(cfg.n_layers):
            g, a = layer_flops(cfg, seq=work.seq_len, moe=cfg.is_moe_layer(i))
            gemm, attn = gemm + g, attn + a
        model_flops = 3 * work.global_batch * (gemm + attn + 2.0 * work.seq_len * cfg.dim * cfg.vocab_size)
        assert step_flops(cfg, work, "full") == pytest.approx(
            (model_flops, model_flops + work.global_batch * (gemm + attn)), rel=1e-12)
        c = param_counts(cfg)
        by_layer = sum(c.attention + c.norms + (c.experts + c.moe_other if cfg.is_moe_layer(i) else c.dense_mlp)
                       for i in range(cfg.n_layers))
        assert total_params(cfg) == by_layer + (1 if cfg.tie_embeddings else 2) * c.embedding + cfg.dim


def test_a_model_of_a_trillion_layers_plans(tmp_path, capsys):
    """ModelConfig takes the depth (its parameters are under the bound) and `phalanx plan`
    prices it: the step's FLOPs are the trillion layers' closed form."""
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(TRILLION))
    cfg = ModelConfig(**{**TRILLION, "dense_layers": tuple(TRILLION["dense_layers"])})
    # MoE layers: the odd indices from 3 on (5e11 - 1 of them), less 5, 7 and 10^12 - 1.
    assert cfg.n_moe_layers == 10**12 // 2 - 1 - 3
    code = cli.run(["plan", "--model", str(path), "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "64",
                     "--seq-len", "128", "--fix", "pp=64,recompute=full,zero=0", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["considered"] > 0 and out["pruned_memory"] == out["considered"]  # 4e14 weights: no fit
    work = Workload(global_batch=64, seq_len=128)
    dense, moe = layer_flops(cfg, seq=128, moe=False), layer_flops(cfg, seq=128, moe=True)
    layers = (cfg.n_layers - cfg.n_moe_layers) * sum(dense) + cfg.n_moe_layers * sum(moe)
    assert step_flops(cfg, work, "none")[0] == pytest.approx(3 * 64 * (layers + 2.0 * 128 * 8 * 256), rel=1e-12)


@pytest.mark.parametrize("m", [5, 20])
def test_deep_zbv_bubble_with_fewer_micro_batches_than_ranks_extends_exactly(m):
    """At least as many ranks as micro-batches: each further rank adds the same idle time."""
    for b, w in ((1.3, 0.7), (0.4, 0.0)):
        for p in (65, 71):
            assert v_bubble("zbv", p, m, 1.0, b, w) == pytest.approx(_timed_bubble("zbv", p, m, 1.0, b, w), rel=1e-9)


def test_deep_zbv_bubble_between_p_and_2p_micro_batches_is_within_two_percent():
    """p <= m < 2p on a deep pipeline: timed at 32 and 64 ranks with the same ratio m / p and
    extended (`pipeline_orders._deep_bubble`); the full timeline at p = 100 decides."""
    for b, w in ((1.3, 0.7), (1.0, 1.0)):
        for m in (120, 199):
            assert v_bubble("zbv", 100, m, 1.0, b, w) == pytest.approx(_timed_bubble("zbv", 100, m, 1.0, b, w),
                                                                       rel=0.02)


def test_building_a_model_deeper_than_a_process_builds_is_refused_first():
    """The layer count's bound moved from ModelConfig to building (`MAX_BUILT_LAYERS`): the
    refusal comes before one module is made."""
    from phalanx.errors import UserError
    from phalanx.model.init import build_model

    with pytest.raises(UserError, match="n_layers=16,385 is above 16,384, the most a process builds"):
        build_model(ModelConfig(n_layers=16385, dim=8, n_heads=2, n_kv_heads=2, ffn_dim=8, vocab_size=16))
