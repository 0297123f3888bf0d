"""The single-device MoE layer against plain per-token formulas.

The reference computes, for every token separately, sum_k weight_k * SwiGLU_{expert_k}(x).
The layer computes the same products on rows grouped by expert, so the only difference is
which rows share a matmul: the fp32 results agree to float rounding (~1e-7 relative; the
tolerance 1e-5 absolute on outputs of size ~1e-2 leaves margin while a wrong expert, weight or
row would be off by the full output).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from phalanx.errors import UserError
from phalanx.model.by_name import model_config
from phalanx.model.moe import MoE
from phalanx.parallel.expert import validate_ep
from phalanx.plan import Plan

TOLERANCE = 1e-5


def _moe(**changes) -> MoE:
    cfg = model_config("tiny-moe").replace(**changes)
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.1)
        moe.router.reset_buffers()
    return moe


def _per_token(moe: MoE, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, keep=None) -> torch.Tensor:
    """sum over chosen (and kept) experts of weight * SwiGLU_e(token), one token at a time."""
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for slot in range(experts.shape[1]):
            if keep is not None and not keep[t, slot]:
                continue
            e, x = int(experts[t, slot]), tokens[t]
            out[t] += weights[t, slot] * (w2[e] @ (F.silu(w1[e] @ x) * (w3[e] @ x)))
    return out


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_grouped_layer_matches_per_token_formula(router):
    moe = _moe(router=router)
    tokens = torch.randn(2, 12, 64)  # (batch, seq, dim)
    out = moe(tokens)
    flat = tokens.reshape(-1, 64)
    route = moe.router(flat)
    torch.testing.assert_close(route.weights.sum(-1), torch.ones(24))
    scores = F.softmax(moe.router.gate(flat), -1) if router == "softmax" else torch.sigmoid(moe.router.gate(flat))
    assert torch.equal(route.experts.sort(-1).values, scores.topk(2, -1).indices.sort(-1).values)
    expected = _per_token(moe, flat, route.experts, route.weights)
    torch.testing.assert_close(out.reshape(-1, 64), expected, atol=TOLERANCE, rtol=0)
    assert moe.tokens_per_expert.sum() == 48 and moe.dropped_tokens == 0
    load = moe.take_load()  # handed to the trainer, and the layer starts counting again
    assert load.tokens_per_expert.sum() == 48 and (load.dropped, load.received) == (0, 48)
    assert torch.equal(load.tokens_per_expert, route.experts.reshape(-1).bincount(minlength=moe.n_experts))
    assert moe.take_load() == type(load)(tokens_per_expert=None, dropped=0, received=0)


def test_shared_experts_add_a_dense_path():
    """DeepSeek-style shared experts: every token also passes a dense SwiGLU of width
    hidden * n_shared_experts, added to the routed output."""
    moe = _moe(n_shared_experts=2)
    assert moe.shared.w1.weight.shape == (2 * 64, 64)  # tiny-moe: expert_ffn_dim 64
    flat = torch.randn(8, 64)
    route = moe.router(flat)
    expected = _per_token(moe, flat, route.experts, route.weights) + moe.shared(flat)
    torch.testing.assert_close(moe(flat), expected, atol=TOLERANCE, rtol=0)


def test_bias_steers_choice_but_not_weights():
    """DeepSeek-V3: the balancing bias only decides which experts are chosen."""
    moe = _moe(router="sigmoid", router_bias_rate=1e-3)
    flat = torch.randn(10, 64)
    moe.router.expert_bias[5] = 100.0  # every token now picks expert 5
    route = moe.router(flat)
    assert (route.experts == 5).any(-1).all()
    scores = torch.sigmoid(moe.router.gate(flat))
    chosen = scores.gather(-1, route.experts)
    torch.testing.assert_close(route.weights, chosen / chosen.sum(-1, keepdim=True))


def test_aux_and_z_losses():
    moe = _moe(aux_loss_coef=0.1, z_loss_coef=0.01)
    flat = torch.randn(16, 64)
    moe(flat)
    route = moe.router(flat)
    fraction = torch.bincount(route.experts.reshape(-1), minlength=8).float() / 32
    balance = 8 * (fraction * route.scores.mean(0)).sum()
    z = torch.logsumexp(route.logits, -1).square().mean()
    torch.testing.assert_close(moe.aux_loss, 0.1 * balance + 0.01 * z)
    moe.aux_loss.backward()  # the balance loss trains the router
    assert moe.router.gate.weight.grad.abs().sum() > 0
    moe.eval()
    moe(flat)
    assert moe.aux_loss is None  # evaluation adds no auxiliary loss


def test_capacity_drops_exactly_the_tokens_over_capacity():
    """Each expert keeps its first ceil(factor * tokens * k / experts) assignments in token
    order and drops the rest; the dropped count is reported; runs are identical."""
    moe = _moe(capacity_factor=0.5)
    flat = torch.randn(40, 64)
    with torch.no_grad():
        moe.router.gate.weight[:2] += 0.3 * flat.mean(0)  # skew toward experts 0 and 1
    route = moe.router(flat)
    capacity = math.ceil(0.5 * 40 * 2 / 8)  # = 5
    seen = torch.zeros(8, dtype=torch.long)
    keep = torch.zeros_like(route.experts, dtype=torch.bool)
    for t in range(40):  # the reference rule, one assignment at a time in token order
        for slot in range(2):
            e = int(route.experts[t, slot])
            keep[t, slot] = bool(seen[e] < capacity)
            seen[e] += 1
    over = int((seen - capacity).clamp(min=0).sum())
    assert over > 0, "routing must overflow some expert for this test to mean anything"
    out = moe(flat)
    assert moe.dropped_tokens == over == int((~keep).sum())
    assert moe.tokens_per_expert.tolist() == seen.clamp(max=capacity).tolist()
    torch.testing.assert_close(out, _per_token(moe, flat, route.experts, route.weights, keep), atol=TOLERANCE, rtol=0)
    assert torch.equal(moe(flat), out)  # deterministic


def test_activation_checkpointing_counts_each_forward_once():
    """Recomputing the layer in backward must not count its tokens (or aux loss) again.

    Early stop off: by default torch stops a recomputation once it has every saved tensor,
    before the statistics at the end of forward, which would hide the double count."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    moe = _moe(aux_loss_coef=0.1)
    flat = torch.randn(16, 64, requires_grad=True)
    with set_checkpoint_early_stop(False):
        out = checkpoint(moe, flat, use_reentrant=False)
    counts, aux = moe.tokens_per_expert.clone(), moe.aux_loss
    (out.sum() + aux).backward()  # reruns moe.forward inside backward
    assert torch.equal(moe.tokens_per_expert, counts) and counts.sum() == 32
    assert moe.aux_loss is aux


def test_config_and_plan_errors_name_the_numbers():
    with pytest.raises(UserError, match="router='topk' must be 'softmax' or 'sigmoid'"):
        model_config("tiny-moe").replace(router="topk")
    with pytest.raises(UserError, match="n_experts=8"):
        validate_ep(model_config("tiny-moe"), Plan(dp=3, ep=3))
    with pytest.raises(UserError, match="has no experts"):
        validate_ep(model_config("tiny"), Plan(dp=2, ep=2))
    with pytest.raises(UserError, match="ep=4 must divide dp=2"):
        Plan(dp=2, ep=4).validate()


def _expert_problem(dtype=torch.float32, device="cpu"):
    """Rows grouped by expert with uneven groups, two idle experts, and a downstream gradient
    that is a plain (not expanded) tensor, as the MoE layer's backward delivers."""
    generator = torch.Generator().manual_seed(3)
    counts = torch.tensor([7, 0, 19, 1, 0, 12])
    draw = lambda *shape: (torch.randn(*shape, generator=generator) / shape[-1] ** 0.5).to(device, dtype)
    return counts.to(device), [draw(39, 32), draw(6, 48, 32), draw(6, 32, 48), draw(6, 48, 32)], draw(39, 32)


def _ffn_and_grads(ffn, counts, inputs, grad):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = ffn(leaves[0], counts, *leaves[1:])
    return [out, *torch.autograd.grad(out, leaves, grad)]


def test_grouped_mm_path_matches_the_loop():
    """One `torch._grouped_mm` per weight gives the loop's output and every gradient (input
    and the three stacked weights) on CPU fp32. Each row's products are the same dot
    products in both, so they agree to float rounding (bit-identical on torch 2.13 CPU);
    1e-5 only allows another kernel's summation order."""
    from phalanx.model.moe import grouped_expert_ffn, grouped_mm_expert_ffn, grouped_mm_works

    counts, inputs, grad = _expert_problem()
    if not grouped_mm_works(inputs[0], inputs[1]):
        pytest.skip("torch._grouped_mm is unavailable or unusable on CPU in this torch; the loop runs")
    loop = _ffn_and_grads(lambda x, c, *w: grouped_expert_ffn(x, c.tolist(), *w), counts, inputs, grad)
    fused = _ffn_and_grads(grouped_mm_expert_ffn, counts, inputs, grad)
    for name, a, b in zip(("out", "x", "w1", "w2", "w3"), loop, fused):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_mm_path_matches_the_loop_on_cuda_bf16():
    """Where the fused path is meant to run: bf16 on a GPU. bf16 keeps 8 bits of mantissa
    (~4e-3 relative per rounding) and the two paths round at different points, hence 3e-2."""
    from phalanx.model.moe import grouped_expert_ffn, grouped_mm_expert_ffn, grouped_mm_works

    counts, inputs, grad = _expert_problem(torch.bfloat16, "cuda")
    if not grouped_mm_works(inputs[0], inputs[1]):
        pytest.skip("torch._grouped_mm does not work on this GPU/torch; the loop runs")
    loop = _ffn_and_grads(lambda x, c, *w: grouped_expert_ffn(x, c.tolist(), *w), counts, inputs, grad)
    fused = _ffn_and_grads(grouped_mm_expert_ffn, counts, inputs, grad)
    for name, a, b in zip(("out", "x", "w1", "w2", "w3"), loop, fused):
        torch.testing.assert_close(b.float(), a.float(), rtol=3e-2, atol=3e-2, msg=name)


def test_grouped_mm_failure_falls_back_to_the_loop(monkeypatch):
    """A `_grouped_mm` that raises (an unsupported device, dtype or torch) is caught by the
    one-time check, and the layer runs the loop instead, with the loop's result."""
    from phalanx.model import moe

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this dtype")

    monkeypatch.setattr(torch, "_grouped_mm", broken, raising=False)
    monkeypatch.setattr(moe, "_GROUPED_MM_CHECKED", {})
    counts, inputs, grad = _expert_problem()
    experts = moe.GroupedExperts(6, 32, 48)
    with torch.no_grad():
        for weight, value in zip((experts.w1, experts.w2, experts.w3), inputs[1:]):
            weight.copy_(value)
    out = experts(inputs[0], counts)
    assert moe._GROUPED_MM_CHECKED == {(inputs[0].device, torch.float32, 32, 48): False}
    torch.testing.assert_close(out, moe.grouped_expert_ffn(inputs[0], counts.tolist(), *inputs[1:]), rtol=0, atol=0)


def test_grouped_mm_check_inside_activation_checkpointing(monkeypatch):
    """The one-time `_grouped_mm` check runs inside the first forward, which may be an
    activation-checkpointed block: its tensors must stay out of the checkpoint's saved ones,
    or the recomputation (which finds the answer cached) saves fewer and raises. The result
    must equal the uncheckpointed layer's."""
    from torch.utils.checkpoint import checkpoint

    from phalanx.model import moe as moe_module

    torch.manual_seed(0)
    layer = MoE(model_config("tiny-moe"))
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.05)
    x = torch.randn(2, 8, 64, requires_grad=True)
    monkeypatch.setattr(moe_module, "_GROUPED_MM_CHECKED", {})  # the check runs in the forward below
    checkpoint(layer, x, use_reentrant=False).square().sum().backward()
    checkpointed = x.grad.clone()
    x.grad = None
    layer(x).square().sum().backward()
    torch.testing.assert_close(checkpointed, x.grad, rtol=0, atol=0)
