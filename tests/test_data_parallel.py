"""Data parallelism computes what one process computes, at every zero level and precision.

Every layout reads the same global batch per step (the batch is a function of seed and step),
starts from the same weights (drawn per parameter name), and averages gradients over equal
shares of the batch, so losses, gradient norms and every rank's weights match the
single-process run up to float reassociation: summing per-rank partial gradients in another
order changes the last bits of fp32 values (~1e-7 relative per op). Over 4 AdamW steps this
stays far below 1e-4, which is the tolerance used; a real bug (wrong batch slice, missing
reduction, double-counted rank) moves the loss by >1e-2 at the first step. zero=2 and
offload=true change where tensors live and when they are gathered, not the arithmetic, so they
are held to the same 1e-4.

bf16 layouts are compared with the bf16 single-process run (bf16 compute weights over fp32
masters; with param_dtype=fp32, autocast over fp32 weights), within the bounds that
phalanx/testing/bf16_bounds.py explains. Plain DDP and zero=3 in bf16 are in
tests/test_mixed_precision.py with the other layouts.

Layouts are grouped by world size: one launch of forked gloo ranks trains a group's layouts
one after another.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx.testing.bf16_bounds import BF16_LOSS, BF16_WEIGHT_MEAN, bf16_grad_norm_bound
from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.weights import gathered_weights
from phalanx.train.loop import train

TOLERANCE = 1e-4

FP32 = {
    2: ["dp=2", "dp=2,fsdp=true", "dp=2,microbatches=2", "dp=2,zero=2", "dp=2,zero=2,microbatches=2",
        "dp=2,zero=3,offload=true"],
    4: ["dp=4,fsdp=true,microbatches=2"],
}
BF16 = [  # (plan, --dtype)
    ("dp=2,reduce_dtype=bf16", "bf16"),  # DDP's bf16_compress_hook on the fp32 master gradients
    ("dp=2,zero=2,reduce_dtype=bf16", "bf16"),  # FSDP2 MixedPrecisionPolicy(bf16, bf16)
    ("dp=2,zero=3,param_dtype=fp32", "bf16"),  # autocast over fp32 weights, gathered in fp32
]


def _dir(plan: str, dtype: str) -> str:
    return f"{plan.replace(',', '_').replace('=', '-') or 'one'}-{dtype}"


def _train_all(cfg, runs: list[tuple[str, str]]) -> dict:
    """On every rank: train each (plan, dtype); return losses and this rank's full weights."""
    out = {}
    for plan, dtype in runs:
        run_dir = Path(cfg.out) / _dir(plan, dtype)
        result = train(cfg.replace(plan=plan, dtype=dtype, out=str(run_dir)), run_dir)
        out[plan, dtype] = (result.losses, gathered_weights(result.model))
    return out


def _grad_norms(cfg, plan: str, dtype: str) -> list[float]:
    lines = (Path(cfg.out) / _dir(plan, dtype) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["grad_norm"] for line in lines]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    from phalanx.train.config import TrainConfig

    return TrainConfig(
        model="tiny", steps=4, global_batch=8, seq_len=32, lr=3e-3, warmup_steps=1, eval_every=0,
        ckpt_every=0, sample_tokens=0, progress=False, plot=False, device="cpu", out=str(tmp_path_factory.mktemp("dp")),
    )


@pytest.fixture(scope="module")
def groups(config):
    """Results per (world size, precision), each launched once on first use."""
    cache: dict = {}

    def get(world: int, bf16: bool = False) -> list[dict]:
        if (world, bf16) not in cache:
            if world == 1:  # the references: fp32, bf16, and bf16 by autocast over fp32 weights
                runs = [("", "fp32"), ("", "bf16"), ("param_dtype=fp32", "bf16")]
            else:
                runs = BF16 if bf16 else [(plan, "fp32") for plan in FP32[world]]
            cache[world, bf16] = run_ranks(world, _train_all, config, runs, timeout_s=300)
        return cache[world, bf16]

    return get


@pytest.mark.parametrize("world, plan", [(w, p) for w, plans in FP32.items() for p in plans])
def test_matches_single_process(config, groups, world, plan):
    ref_losses, ref_weights = groups(1)[0]["", "fp32"]
    for rank_results in groups(world):  # every rank's copy, not one
        losses, weights = rank_results[plan, "fp32"]
        assert len(losses) == len(ref_losses)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOLERANCE, (losses, ref_losses)
        assert weights.keys() == ref_weights.keys()
        for name, value in weights.items():
            torch.testing.assert_close(value, ref_weights[name], atol=TOLERANCE, rtol=TOLERANCE, msg=name)
    # Clipping is active (norms ~3-4 > 1): the norm must be the whole batch's, over all shards.
    for norm, ref in zip(_grad_norms(config, plan, "fp32"), _grad_norms(config, "", "fp32")):
        assert abs(norm - ref) < TOLERANCE * ref, (plan, norm, ref)


@pytest.mark.parametrize("plan, dtype", BF16)
def test_bf16_matches_single_process(config, groups, plan, dtype):
    """The one-process reference runs the same precision mode (mixed, or autocast with
    param_dtype=fp32); the bounds and their reasons are in phalanx/testing/bf16_bounds.py."""
    reference = "param_dtype=fp32" if "param_dtype=fp32" in plan else ""
    ref_losses, ref_weights = groups(1)[0][reference, dtype]
    for rank_results in groups(2, bf16=True):
        losses, weights = rank_results[plan, dtype]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < BF16_LOSS, (losses, ref_losses)
        assert weights.keys() == ref_weights.keys()
        diff = sum(float((w - ref_weights[k]).abs().sum()) for k, w in weights.items())
        assert diff / sum(w.numel() for w in weights.values()) < BF16_WEIGHT_MEAN
    for step, (norm, ref) in enumerate(zip(_grad_norms(config, plan, dtype), _grad_norms(config, reference, dtype)), 1):
        assert abs(norm - ref) < bf16_grad_norm_bound(step) * ref, (plan, step, norm, ref)


def test_single_process_training_lowers_loss(tiny_config):
    cfg = tiny_config.replace(steps=30, lr=1e-2, warmup_steps=3)
    losses = run_ranks(1, _train_all, cfg, [("", "fp32")])[0]["", "fp32"][0]
    # Bytes start at ln(256) = 5.55 nats; 30 steps on Python source reach well under 4.
    assert losses[0] > 5.0
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5


def test_fsdp_units_below_the_block_are_attention_and_each_mlp_linear():
    """zero=3 shards the attention and each linear of a dense MLP as FSDP units of their own
    (the block keeps its norms; an MoE block keeps its router, its experts being units already);
    the zero=3 cases above run them against one process."""
    from phalanx.model.by_name import model_config
    from phalanx.model.transformer import Transformer
    from phalanx.parallel.data_parallel import sub_block_units

    dense = Transformer(model_config("tiny")).layers["0"]
    mlp = dense.feed_forward
    assert sub_block_units(dense) == [dense.attention] + [linear for linear in (mlp.w1, mlp.w3, mlp.w2) if linear is not None]
    moe = Transformer(model_config("tiny-moe"))
    block = next(b for b in moe.layers.values() if not hasattr(b.feed_forward, "w1"))
    assert sub_block_units(block) == [block.attention]
