"""oneDNN's linear for inference on CPU (`phalanx/cpu_ops/onednn_linear.py`) computes what
nn.Linear computes, only while no gradient is wanted, and only where it may.

Tolerance: the same fp32 products summed in another order, ~1e-6 relative on these O(1)-O(10)
outputs (measured: at most 5e-6 over 512-term sums); 1e-5 relative + 1e-5 absolute, the serving
tests' bound. A wrong transpose, a dropped bias or a wrong expert moves outputs by O(1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.cpu_ops import onednn_linear
from phalanx.model.config import ModelConfig
from phalanx.cpu_ops.onednn_linear import OneDnnLinear, onednn_works, use_onednn
from phalanx.model.transformer import Transformer

if not onednn_works(torch.float32):
    pytest.skip("this torch has no usable oneDNN linear (the layers keep F.linear)", allow_module_level=True)

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def every_product(monkeypatch):
    """oneDNN for every product, however small (these tests' layers are under ONEDNN_MIN_MACS)."""
    monkeypatch.setattr(onednn_linear, "ONEDNN_MIN_MACS", 0)


def _tiny_moe() -> Transformer:
    cfg = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, n_experts=4,
                      experts_per_token=2, expert_ffn_dim=48, attention_bias=True, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
    return model.eval()


@pytest.mark.parametrize("shape", [(1, 512), (8, 512), (32, 512), (3, 7, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_nn_linear_without_gradients(every_product, shape, bias):
    torch.manual_seed(1)
    plain = nn.Linear(512, 384, bias=bias)
    fast = OneDnnLinear(512, 384, bias=bias)
    fast.load_state_dict(plain.state_dict())
    x = torch.randn(*shape)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), plain(x), **TOL)


def test_with_gradients_it_is_nn_linear(monkeypatch):
    """Training must keep autograd's linear: the oneDNN op is not even called."""
    calls = []
    monkeypatch.setattr(onednn_linear, "onednn_linear", lambda *a: calls.append(a))
    torch.manual_seed(2)
    layer = OneDnnLinear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    out = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias)) and not calls
    out.sum().backward()
    assert layer.weight.grad is not None and x.grad is not None


def test_a_model_gives_the_same_logits_and_keeps_its_state(every_product):
    """Every Linear of a tiny MoE model (attention with biases, router, dense output) re-classed,
    the experts marked; logits of a 2 x 9 batch as before; the state dict untouched."""
    model = _tiny_moe()
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(tokens)
    keys = list(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert use_onednn(model) == linears + 2  # + the two layers' routed experts
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert all(layer.feed_forward.experts.onednn for layer in model.layers.values())
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        after = model(tokens)
    torch.testing.assert_close(after, before, **TOL)


def test_expert_products_go_through_onednn(every_product, monkeypatch):
    """The marked experts' loop runs the oneDNN product (not the grouped kernel) without
    gradients, and F.linear with them."""
    model = _tiny_moe()
    use_onednn(model)
    calls = []
    real = onednn_linear.onednn_linear
    monkeypatch.setattr(onednn_linear, "onednn_linear", lambda *a: calls.append(1) or real(*a))
    tokens = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(tokens)
    assert len(calls) >= 2 * 3  # two layers, three products per expert that received rows
    calls.clear()
    model(tokens).sum().backward()  # with gradients: the training path
    assert not calls


def test_small_products_stay_mkl(monkeypatch):
    """Under ONEDNN_MIN_MACS multiply-adds (rows x in x out) F.linear runs, at and above it oneDNN."""
    calls = []
    real = onednn_linear.onednn_linear
    monkeypatch.setattr(onednn_linear, "onednn_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    layer = OneDnnLinear(512, 512, bias=False)
    with torch.no_grad():
        layer(torch.randn(1, 512))  # 262,144: the threshold itself
        layer(torch.randn(2, 256, 512)[:, :1])  # one row again, as a 3-d view
        OneDnnLinear(512, 8, bias=False)(torch.randn(32, 512))  # a router: 131,072
    assert calls == [(1, 512), (2, 1, 512)]


def test_nothing_changes_where_onednn_does_not_work(monkeypatch):
    monkeypatch.setitem(onednn_linear._WORKS, torch.float32, False)
    model = _tiny_moe()
    assert use_onednn(model) == 0
    assert any(type(m) is nn.Linear for m in model.modules())
    assert not any(layer.feed_forward.experts.onednn for layer in model.layers.values())


def test_a_failing_op_means_f_linear(monkeypatch):
    """The one-time check: an op that raises (absent overload, unsupported dtype) or disagrees."""
    def broken(*args):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(onednn_linear, "onednn_linear", broken)
    monkeypatch.delitem(onednn_linear._WORKS, torch.float64, raising=False)
    assert not onednn_works(torch.float64)
    monkeypatch.setattr(onednn_linear, "onednn_linear", lambda x, w, b=None: F.linear(x, w, b) + 1)
    assert not onednn_linear._agrees(torch.float32)


def _blocked_model() -> Transformer:
    model = _tiny_moe()
    use_onednn(model, blocked=True)
    return model


@pytest.mark.skipif(not onednn_linear.blocking_works(torch.float32), reason="oneDNN's blocked copies do not work here")
def test_blocked_copies_give_the_plain_products(every_product):
    """Blocked copies change where oneDNN reads a weight from: the logits equal the plain oneDNN
    model's within TOL (oneDNN may pick another kernel for the blocked layout, and so another
    order of the sums: equal bit for bit at most shapes, 2e-6 apart at one row of 48 -> 64), and
    every module holds copies of its own weights only."""
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    plain, blocked = _tiny_moe(), _blocked_model()
    use_onednn(plain, blocked=False)
    assert not any(getattr(m, "blocked", None) for m in plain.modules())
    with torch.no_grad():
        torch.testing.assert_close(blocked(tokens), plain(tokens), **TOL)
    experts = blocked.layers["0"].feed_forward.experts
    assert 0 < len(experts.blocked.copies) <= 2 * experts.w1.shape[0]  # gate|up and down per expert
    assert blocked.output.blocked.copy is not None


@pytest.mark.skipif(not onednn_linear.blocking_works(torch.float32), reason="oneDNN's blocked copies do not work here")
def test_a_weight_changed_in_place_is_copied_again(every_product):
    """Expert re-placement copies into the stacked experts in place, and a loaded weight may be
    overwritten: the next product must read the new values, not the stale copy."""
    model = _blocked_model()
    reference = _tiny_moe()
    use_onednn(reference, blocked=False)
    tokens = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model(tokens)  # the copies are made
        for m in (model, reference):
            experts = m.layers["1"].feed_forward.experts
            experts.w1[0].copy_(experts.w1[1])  # expert 1's slot copied over expert 0's, as a move does
            m.output.weight.mul_(2)
        torch.testing.assert_close(model(tokens), reference(tokens), **TOL)


def test_blocked_copies_only_where_they_fit(monkeypatch):
    """Kept when the copies (times this machine's ranks) take at most a quarter of the available
    memory; not at all where the available memory is unknown."""
    model = _tiny_moe()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(onednn_linear, "_available_memory", lambda: 4 * weights)
    assert onednn_linear.blocked_copies_fit(model)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not onednn_linear.blocked_copies_fit(model)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(onednn_linear, "_available_memory", lambda: 4 * weights - 1)
    assert not onednn_linear.blocked_copies_fit(model)
    use_onednn(model)
    assert not any(getattr(m, "blocked", None) for m in model.modules())
    monkeypatch.setattr(onednn_linear, "_available_memory", lambda: None)
    assert not onednn_linear.blocked_copies_fit(model)
