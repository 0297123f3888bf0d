"""Routing-weight normalization (`norm_topk_prob`) and a frozen balancing bias.

Top-1 routing normalized over its one chosen expert has weight exactly 1 whatever the gate
says, so the loss gives the router no gradient at all; unnormalized, the weight is the
chosen expert's probability and the gradient is that of the per-token formula
sum_k weight_k * SwiGLU_{expert_k}(x) (`test_moe_layer._per_token`). The layer and the formula
differ only in which rows share a matmul: fp32 rounding, ~1e-7 relative; TOLERANCE = 1e-5
relative to the gradient's size leaves margin, while a missing or wrong weight is off by the
whole gradient.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from phalanx.model import config as model_config_module
from phalanx.model.by_name import model_config
from phalanx.model.hf_config import from_hf_dict
from phalanx.model.init import RandomWeights
from phalanx.model.router import Router
from phalanx.testing.fork_ranks import run_ranks
from tests.test_moe_layer import _moe, _per_token

TOLERANCE = 1e-5
GATE = "layers.0.feed_forward.router.gate.weight"


def test_top1_presets_do_not_normalize_and_topk_ones_do():
    for cfg in model_config_module.PRESETS.values():
        assert cfg.routing_normalized == (cfg.experts_per_token > 1), cfg.name
    top1 = model_config("tiny-moe").replace(experts_per_token=1)
    assert not top1.routing_normalized
    assert top1.replace(norm_topk_prob=True).routing_normalized  # an explicit setting wins
    assert not model_config("tiny-moe").replace(norm_topk_prob=False).routing_normalized


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_top1_router_gets_the_gradient_of_the_per_token_formula(router):
    moe = _moe(experts_per_token=1, router=router)
    tokens, target = torch.randn(24, 64), torch.randn(24, 64)
    (moe(tokens) * target).sum().backward()
    layer_grad = moe.router.gate.weight.grad.clone()

    moe.zero_grad()
    logits = moe.router.gate(tokens)
    scores = F.softmax(logits, -1) if router == "softmax" else torch.sigmoid(logits)
    experts = scores.topk(1, -1).indices  # (tokens, 1)
    (_per_token(moe, tokens, experts, scores.gather(-1, experts)) * target).sum().backward()
    expected = moe.router.gate.weight.grad
    assert expected.abs().max() > 1e-3  # the formula's gradient is far from zero
    torch.testing.assert_close(layer_grad, expected, atol=TOLERANCE * float(expected.abs().max()), rtol=0)


def test_normalized_top1_router_gets_only_rounding_noise():
    """What `norm_topk_prob=None` avoids for top-1: every weight is c / c = 1, whose gradient
    is rounding noise (~1e-7 relative to the real one), which Adam would scale up into
    steps of size lr in random directions."""
    tokens, target = torch.randn(24, 64), torch.randn(24, 64)
    grads = []
    for norm_topk_prob in (True, False):
        moe = _moe(experts_per_token=1, norm_topk_prob=norm_topk_prob)
        (moe(tokens) * target).sum().backward()
        grads.append(moe.router.gate.weight.grad.abs().max())
    assert grads[0] < 1e-5 * grads[1]


def _train_gate(cfg):
    from phalanx.train.loop import train

    result = train(cfg, Path(cfg.out))
    return dict(result.model.named_parameters())[GATE].detach().clone()


@pytest.mark.parametrize("norm_topk_prob", [None, True])
def test_top1_training_moves_the_router(monkeypatch, tiny_config, norm_topk_prob):
    """Two steps of `phalanx train` on a top-1 tiny-moe without weight decay: the router's
    weight moves from its initial value (drawn again here from the seed) only when the loss
    reaches it. AdamW moves an element whose gradient is well above its eps (1e-8) by about
    lr = 3e-3 per step (measured: median 5.4e-3 after two steps); renormalized, the
    gradient is rounding noise far below eps, and the steps are tiny (median 4e-7)."""
    model = model_config_module.PRESETS["tiny-moe"].replace(experts_per_token=1, norm_topk_prob=norm_topk_prob)
    monkeypatch.setitem(model_config_module.PRESETS, "tiny-moe", model)  # forked ranks inherit it
    cfg = tiny_config.replace(model="tiny-moe", steps=2, weight_decay=0.0)
    final = run_ranks(1, _train_gate, cfg)[0]
    initial = RandomWeights(model, cfg.seed).read(GATE, final.shape, [None, None])
    moved = float((final - initial).abs().median())
    assert moved > 1e-3 if norm_topk_prob is None else moved < 1e-5


def test_zero_bias_rate_freezes_a_learned_bias():
    """A bias learned at a positive rate, loaded into a router with rate 0 (a run resumed
    with balancing turned off): it still steers the choice, and updates leave it alone."""
    learning = Router(64, 8, 2, score="sigmoid", bias_rate=0.5)
    learning.update_bias(torch.tensor([0, 0, 0, 0, 0, 0, 0, 100]))  # expert 7 overloaded: -0.5, others +0.5
    learning.update_bias(torch.tensor([0, 100, 100, 100, 100, 100, 100, 100]))  # expert 0 idle: +0.5 more
    frozen = Router(64, 8, 2, score="sigmoid", bias_rate=0.0)
    frozen.load_state_dict(learning.state_dict())
    x = torch.randn(32, 64)
    want = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, -1.0])
    torch.testing.assert_close(frozen.expert_bias, want, atol=0, rtol=0)
    route, steered = frozen(x), learning(x)
    assert torch.equal(route.experts, steered.experts) and torch.equal(route.weights, steered.weights)
    assert (route.experts == 0).any(-1).all()  # a bias of +1 on sigmoid scores in (0, 1) always wins
    assert not (route.experts == 7).any()
    frozen.update_bias(torch.tensor([100, 0, 0, 0, 0, 0, 0, 0]))
    torch.testing.assert_close(frozen.expert_bias, want, atol=0, rtol=0)


def _qwen3_moe(**extra) -> dict:
    return {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, **extra}


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), (None, False)])
def test_hugging_face_configs_say_whether_to_normalize(value, expected):
    """Qwen3-MoE's norm_topk_prob is read (absent: transformers' default, False); Mixtral
    always renormalizes; the shape-only families read it too (DeepSeek-V3's default: True)."""
    extra = {} if value is None else {"norm_topk_prob": value}
    assert from_hf_dict(_qwen3_moe(**extra), source="config.json").routing_normalized is expected
    deepseek = {"model_type": "deepseek_v3", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "intermediate_size": 48, "moe_intermediate_size": 16,
                "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, **extra}
    assert from_hf_dict(deepseek, source="config.json", trainable=False).routing_normalized is (value is not False)
    mixtral = {**_qwen3_moe(), "model_type": "mixtral", "num_local_experts": 4}
    assert from_hf_dict(mixtral, source="config.json").routing_normalized is True
