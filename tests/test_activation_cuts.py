"""Each saved-tensor cut of issue 20 holds, and computes what it replaced.

Saved tensors are read with `torch.autograd.graph.saved_tensors_hooks`, one entry per storage
(a view saved twice costs once), in bf16 where the cut is about 16-bit activations. Each test
names the tensor that would come back if its cut were undone. The sequence-parallel cut is
checked on 2 gloo ranks against the same ranks without sp (gradients equal to 1e-6: the gather
is exact, only the reduction order of the row-parallel sums may differ); equality with one
process is test_hybrid_layouts.py's and test_tensor_parallel.py's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from phalanx.model.by_name import model_config
from phalanx.testing.fork_ranks import run_ranks


def _saved(fn, skip=()) -> list[tuple[tuple, torch.dtype, int]]:
    """(shape, dtype, bytes) of each storage saved for backward while fn runs, parameters
    (`skip`) left out."""
    skipped = {t.untyped_storage().data_ptr() for t in skip}
    seen: dict[int, tuple] = {}

    def pack(t):
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        local = getattr(local, "elem", local)  # a collective's result not yet waited on
        ptr = local.untyped_storage().data_ptr()
        if ptr not in skipped and ptr not in seen:
            seen[ptr] = (tuple(local.shape), local.dtype, local.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return list(seen.values()), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_torch_forward_and_backward(dtype):
    """Bit-identical output; gradients as torch's composite computes them (measured equal)."""
    from phalanx.model.rms_norm import RMSNorm

    torch.manual_seed(0)
    reference = nn.RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(1 + 0.1 * torch.randn(64))
    norm = RMSNorm(64, eps=1e-5).to(dtype)
    norm.load_state_dict(reference.state_dict(), strict=True)  # the same key: checkpoints load
    x, grad = torch.randn(2, 8, 64, dtype=dtype), torch.randn(2, 8, 64, dtype=dtype)
    results = []
    for module in (reference, norm):
        leaf = x.clone().requires_grad_()
        out = module(leaf)
        out.backward(grad)
        results.append((out, leaf.grad, module.weight.grad))
    (out_a, gx_a, gw_a), (out_b, gx_b, gw_b) = results
    assert torch.equal(out_a, out_b)
    with torch.no_grad():  # inference skips the autograd function: still the same numbers
        assert torch.equal(norm(x), out_b) and torch.equal(reference(x), out_b)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # fp32: summation order; bf16: one rounding
    for a, b in ((gx_a, gx_b), (gw_a, gw_b)):
        assert float((a.float() - b.float()).abs().max()) <= tolerance * float(a.float().abs().max())


def test_rms_norm_saves_its_input_and_rstd_only():
    """A bf16 input is saved as it is (2 bytes per element) with one fp32 rstd per row; torch's
    CPU composite saves the input upcast to fp32 and the fp32 x * rstd besides (8 bytes more)."""
    from phalanx.model.rms_norm import RMSNorm

    norm = RMSNorm(64).to(torch.bfloat16)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    saved, _ = _saved(lambda: norm(x), skip=[norm.weight])
    assert sorted(saved) == sorted([((2, 8, 64), torch.bfloat16, x.nbytes), ((2, 8, 1), torch.float32, 2 * 8 * 4)])


def test_gqa_attention_saves_k_and_v_unrepeated():
    """tiny: 4 query heads, 2 kv heads. Saved: q and the output at 4 heads, k and v at 2 (the
    CPU kernel of scaled_dot_product_attention(enable_gqa=True) does not keep them repeated)."""
    from phalanx.model.rotary import rotary_tables
    from phalanx.model.transformer import Attention

    cfg = model_config("tiny")
    attention = Attention(cfg).to(torch.bfloat16)
    x = torch.randn(2, 16, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    rope = rotary_tables(cfg)  # a buffer of the model, not an activation
    saved, _ = _saved(lambda: attention(x, rope), skip=[*attention.parameters(), rope])
    per_head = [shape for shape, _, _ in saved if len(shape) == 4]  # (batch, heads, seq, head_dim)
    assert sorted(per_head) == sorted([(2, 2, 16, 16), (2, 2, 16, 16), (2, 4, 16, 16), (2, 4, 16, 16)])


def test_moe_combine_saves_the_expert_rows_once():
    """The combine keeps the experts' output rows (for the combine weights' gradient) but not
    the weighted rows that index_add_ would keep: of the (assignments, dim) tensors only the
    rows the experts read and the rows they wrote are saved. Experts' hidden size differs from
    dim, so their (assignments, hidden) tensors cannot be mistaken for these."""
    from phalanx.model.moe import MoE

    cfg = dataclasses.replace(model_config("tiny-moe"), expert_ffn_dim=96)
    torch.manual_seed(0)
    moe = MoE(cfg).to(torch.bfloat16)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.05)
    x = torch.randn(2, 16, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    saved, _ = _saved(lambda: moe(x), skip=list(moe.parameters()))
    assignments = 2 * 16 * cfg.experts_per_token
    assert [s for s in saved if s[0] == (assignments, cfg.dim)] == [((assignments, cfg.dim), torch.bfloat16,
                                                                     assignments * cfg.dim * 2)] * 2


def test_moe_combine_equals_multiply_and_index_add():
    from phalanx.model.moe import WeightedCombine
    from phalanx.model.moe import combine as moe_combine

    torch.manual_seed(0)
    rows, weights = torch.randn(12, 8, requires_grad=True), torch.rand(12, 1, requires_grad=True)
    index, tokens = torch.randint(0, 5, (12,)), torch.zeros(5, 8)
    grad = torch.randn(5, 8)
    results = []
    for combine in (lambda: WeightedCombine.apply(rows, weights, index, tokens),
                    lambda: torch.zeros_like(tokens).index_add_(0, index, rows * weights)):
        out = combine()
        results.append([out, *torch.autograd.grad(out, (rows, weights), grad)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with torch.no_grad():  # inference takes moe.combine's path without the autograd function
        assert torch.equal(moe_combine(rows, weights, index, tokens), results[0][0])


PLANS = ("tp=2", "tp=2,sp=true", "tp=2,sp=true,recompute=full", "tp=2,sp=true,recompute=selective")


def _sp_rank() -> dict:
    import torch.distributed as dist

    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.mesh import build_mesh
    from phalanx.parallel.tensor_parallel import loss_context
    from phalanx.plan import plan_from_string
    from phalanx.train.loss import token_loss

    cfg = dataclasses.replace(model_config("tiny"), ffn_dim=192)  # 96 hidden units per rank: never dim wide
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    out = {}
    for text in PLANS:
        mesh = build_mesh(plan_from_string(text, dist.get_world_size()), torch.device("cpu"))
        model = parallelize(cfg, mesh, seed=0)
        params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        with loss_context(mesh.plan):
            saved, loss = _saved(lambda: token_loss(model(tokens[:, :-1]), tokens[:, 1:]), skip=params)
            loss.backward()
        grads = {name.replace("_checkpoint_wrapped_module.", ""): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for name, p in model.named_parameters()}
        out[text] = {"saved": saved, "grads": grads, "loss": float(loss.full_tensor())}
    return out


@pytest.fixture(scope="module")
def sp_ranks():
    return run_ranks(2, _sp_rank)


def test_sequence_parallel_keeps_shards_not_gathered_inputs(sp_ranks):
    """tiny (ffn 192), batch 2, seq 32, dim 64, tp=2: with sp no saved tensor of dim-wide rows covers the
    whole sequence (2 x 32 rows): the residual stream, the norms' inputs and the gathered inputs
    of the column-parallel matrices (output projection included) are kept as this rank's half.
    Without sp they are whole."""
    whole = 2 * 32 * 64
    for rank in sp_ranks:
        def whole_rows(text):
            return [s for s in rank[text]["saved"] if s[0] and s[0][-1] == 64 and torch.Size(s[0]).numel() == whole]
        assert whole_rows("tp=2")  # the check can see them
        assert whole_rows("tp=2,sp=true") == []


def test_sequence_parallel_gathers_again_correctly(sp_ranks):
    """Gradients with the shards gathered again in backward, also through activation
    checkpointing's hooks (recompute=full and selective), equal those without sp."""
    for rank in sp_ranks:
        reference = rank["tp=2"]
        for text in PLANS[1:]:
            assert abs(rank[text]["loss"] - reference["loss"]) < 1e-5
            for name, grad in reference["grads"].items():
                torch.testing.assert_close(rank[text]["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=f"{text} {name}")
