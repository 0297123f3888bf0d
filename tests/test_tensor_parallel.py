"""What tensor parallelism leaves on each rank: shard shapes, vocab-sharded logits, the plan table.

Numerical equivalence with one process is in test_hybrid_layouts.py; this checks the layout
itself, which equivalence alone would not catch (a model that silently stayed replicated
computes the right numbers too).
"""

from __future__ import annotations

import pytest
import torch

from phalanx.model.by_name import model_config
from phalanx.testing.fork_ranks import run_ranks


def _shapes_on_rank(plan_texts: list[str]) -> dict:
    return {text: _shapes_of_plan(text) for text in plan_texts}


def _shapes_of_plan(plan_text: str) -> dict:
    import torch.distributed as dist

    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.mesh import build_mesh
    from phalanx.parallel.tensor_parallel import loss_context
    from phalanx.plan import plan_from_string
    from phalanx.train.loss import token_loss

    cfg = model_config("tiny")
    mesh = build_mesh(plan_from_string(plan_text, dist.get_world_size()), torch.device("cpu"))
    model = parallelize(cfg, mesh, seed=0)
    seen = {}  # the local shape of what the first norm receives: sp splits it along the sequence

    def record(module, args):
        seen["norm_input"] = tuple(args[0].to_local().shape if hasattr(args[0], "to_local") else args[0].shape)

    model.layers["0"].attention_norm.register_forward_pre_hook(record)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with loss_context(mesh.plan):
        logits = model(tokens)
        loss = token_loss(logits, tokens)
        loss.backward()
    local = {name: tuple(p.to_local().shape) for name, p in model.named_parameters() if hasattr(p, "to_local")}
    return {"params": local, "logits": tuple(logits.to_local().shape), "loss": float(loss.full_tensor()), **seen}


@pytest.fixture(scope="module")
def tp2_ranks():
    return run_ranks(2, _shapes_on_rank, ["tp=2,sp=true", "tp=2"])


@pytest.mark.parametrize("plan", ["tp=2,sp=true", "tp=2"])
def test_each_rank_holds_its_slice(plan, tp2_ranks):
    """tiny: dim 64, 4 heads of 16, 2 kv heads, ffn 128, vocab 256; tp=2 halves each split dim."""
    cfg = model_config("tiny")
    ranks = [result[plan] for result in tp2_ranks]
    for result in ranks:
        params = result["params"]
        assert params["layers.0.attention.wq.weight"] == (cfg.n_heads * cfg.head_dim // 2, cfg.dim)
        assert params["layers.0.attention.wk.weight"] == (cfg.n_kv_heads * cfg.head_dim // 2, cfg.dim)
        assert params["layers.0.attention.wo.weight"] == (cfg.dim, cfg.n_heads * cfg.head_dim // 2)
        assert params["layers.0.feed_forward.w1.weight"] == (cfg.ffn_dim // 2, cfg.dim)
        assert params["layers.0.feed_forward.w2.weight"] == (cfg.dim, cfg.ffn_dim // 2)
        assert params["tok_embeddings.weight"] == (cfg.vocab_size // 2, cfg.dim)
        assert params["output.weight"] == (cfg.vocab_size // 2, cfg.dim)
        # No rank ever holds full-vocabulary logits: (batch, seq, vocab / tp).
        assert result["logits"] == (2, 32, cfg.vocab_size // 2)
    assert ranks[0]["loss"] == ranks[1]["loss"]


def test_sequence_parallel_shards_the_norm_regions(tp2_ranks):
    """sp=true changes what is sharded, not only the plan table: each rank's norm receives its
    half of the sequence (batch 2, seq 32 / 2, dim 64) instead of the whole (replicated) one;
    the matrices are sharded the same way, every norm's weight becomes a replicated DTensor (whole,
    (64,)), and the loss stays the same."""
    for result in tp2_ranks:
        sp, plain = result["tp=2,sp=true"], result["tp=2"]
        assert sp["norm_input"] == (2, 16, 64)
        assert plain["norm_input"] == (2, 32, 64)
        assert {name: sp["params"][name] for name in plain["params"]} == plain["params"]
        assert {name: shape for name, shape in sp["params"].items() if name not in plain["params"]} == {
            **{f"layers.{i}.{norm}.weight": (64,) for i in range(4) for norm in ("attention_norm", "ffn_norm")},
            "norm.weight": (64,),
        }
    assert abs(tp2_ranks[0]["tp=2,sp=true"]["loss"] - tp2_ranks[0]["tp=2"]["loss"]) < 1e-5


def test_plan_table_is_data():
    """The block plan is a table keyed by module name; sp adds the norm entries (the gathers
    before attention and the MLP are `sequence_parallel.gather_sequence`, keeping shards)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from phalanx.parallel.tensor_parallel import block_plan

    plain, sp = block_plan(sp=False), block_plan(sp=True)
    assert {k for k, v in plain.items() if isinstance(v, ColwiseParallel)} == {
        "attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"}
    assert {k for k, v in plain.items() if isinstance(v, RowwiseParallel)} == {"attention.wo", "feed_forward.w2"}
    assert {k for k, v in sp.items() if isinstance(v, SequenceParallel)} == {"attention_norm", "ffn_norm"}
    assert set(sp) - set(plain) == {"attention_norm", "ffn_norm"}
