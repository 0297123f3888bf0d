"""Data parallelism computes what one process computes.

Every layout reads the same global batch per step (the batch is a function of seed and step),
starts from the same weights (drawn per parameter name), and averages gradients over equal
shares of the batch, so losses and weights match the single-process run up to float
reassociation: summing per-rank partial gradients in another order changes the last bits of
fp32 values (~1e-7 relative per op). Over 4 AdamW steps this stays far below 1e-4, which is
the tolerance used; a real bug (wrong batch slice, missing reduction, double-counted rank)
moves the loss by >1e-2 at the first step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.weights import gathered_weights
from phalanx.train.loop import train

TOLERANCE = 1e-4


def _run(cfg):
    result = train(cfg, Path(cfg.out))
    return result.losses, gathered_weights(result.model)


@pytest.fixture
def reference(tiny_config):
    return run_ranks(1, _run, tiny_config.replace(out=tiny_config.out + "-ref"))[0]


@pytest.mark.parametrize("plan", ["dp=2", "dp=2,fsdp=true", "dp=4,fsdp=true,microbatches=2", "dp=2,microbatches=2"])
def test_matches_single_process(tiny_config, reference, plan):
    world = int(plan.split(",")[0].split("=")[1])
    results = run_ranks(world, _run, tiny_config.replace(plan=plan))
    ref_losses, ref_weights = reference
    for losses, weights in results:
        assert len(losses) == len(ref_losses)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOLERANCE, (losses, ref_losses)
        assert weights.keys() == ref_weights.keys()
        for name, value in weights.items():
            torch.testing.assert_close(value, ref_weights[name], atol=TOLERANCE, rtol=TOLERANCE, msg=name)


def test_single_process_training_lowers_loss(tiny_config):
    cfg = tiny_config.replace(steps=30, lr=1e-2, warmup_steps=3)
    losses = run_ranks(1, _run, cfg)[0][0]
    # Bytes start at ln(256) = 5.55 nats; 30 steps on Python source reach well under 4.
    assert losses[0] > 5.0
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
