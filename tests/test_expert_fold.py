"""MoE parallel folding (`ep_over_tp=true`): tp ranks split the expert work, and the layout
still trains tiny-moe exactly as one process does.

Same comparison and tolerance as tests/test_expert_parallel.py (whose helpers this reuses):
routing is decided per token on replicated activations, so every assignment visits the same
expert with the same weight as in one process; slicing rows over tp, all-to-all and all-gather
move rows without arithmetic. What differs is float summation order (an expert's weight
gradient sums its rows from other ranks in another order, edp/dp and the norm's partial sums
add ranks in another order): ~1e-7 relative per op, below 1e-5 after 3 AdamW steps, hence
TOLERANCE = 1e-4. A wrong backward of either tp move (summing instead of slicing, or a partial
input gradient) scales gradients by tp or drops half of them, far past that.
"""

from __future__ import annotations

import pytest

from phalanx.errors import UserError
from phalanx.plan import plan_from_string
from phalanx.testing.fork_ranks import run_ranks
from tests.moe_runs import check_load_records, compare, expert_counts, run_and_gather


@pytest.mark.parametrize("plan", ["tp=2,ep=2,ep_over_tp=true", "dp=2,tp=2,ep=4,ep_over_tp=true,fsdp=true"])
def test_folded_layout_matches_single_process(moe_config, moe_reference, plan):
    """tp=2,ep=2: the tp pair is the ep group, each rank computes half the rows and holds half
    the experts (hook-reduced, no dp). dp=2,tp=2,ep=4: one ep group over all four ranks (each
    rank 1/4 of the experts, more than dp=2 allows without folding), under FSDP."""
    dp = 2 if plan.startswith("dp=2") else 1
    cfg = moe_config.replace(plan=plan, global_batch=8, out=f"{moe_config.out}-{plan}")
    results = run_ranks(4 if dp == 2 else 2, run_and_gather, cfg)
    compare(results, moe_reference)
    # One rank column per dp x tp rank, adding up to the assignments (not tp times them): each
    # rank's experts computed only rows of its own tp slice.
    check_load_records(cfg, dp=dp * 2)
    assert expert_counts(cfg.out) == expert_counts(moe_config.out + "-ref")


@pytest.mark.parametrize("text, message", [
    ("dp=2,tp=2,ep=3,ep_over_tp=true", "ep=3 must divide dp x tp = 4"),
    ("dp=2,ep=2,ep_over_tp=true", "ep_over_tp=true spreads experts over the tp ranks too and needs tp > 1"),
    ("tp=2,ep_over_tp=true", "needs tp > 1 and ep > 1, got tp=2, ep=1"),
    ("tp=2,ep=2", "ep=2 must divide dp=1"),
])
def test_bad_plans_refused(text, message):
    with pytest.raises(UserError, match=message) as error:
        plan_from_string(text)
    assert "\n" not in str(error.value)


def test_plan_round_trips():
    plan = plan_from_string("dp=2,tp=2,ep=4,ep_over_tp=true")
    assert plan.ep_over_tp and plan_from_string(plan.to_string()) == plan


def test_resume_across_folded_and_unfolded_layouts(tiny_config):
    """A checkpoint of the folded dp=2,tp=2,ep=4 layout (FSDP experts over an ep group that spans
    tp) resumes under dp=2,ep=2 as the uninterrupted folded run continues (same tolerance)."""
    import shutil
    from pathlib import Path

    import torch

    from tests.test_expert_checkpoint import _run as run_checkpointed

    cfg = tiny_config.replace(model="tiny-moe", steps=4, ckpt_every=2, plan="dp=2,tp=2,ep=4,ep_over_tp=true,fsdp=true")
    full_losses, full_weights = run_ranks(4, run_checkpointed, cfg)[0]
    resumed_dir = Path(cfg.out + "-resumed")
    shutil.copytree(Path(cfg.out) / "checkpoints" / "step_000002", resumed_dir / "checkpoints" / "step_000002")
    for losses, weights in run_ranks(2, run_checkpointed, cfg.replace(plan="dp=2,ep=2", out=str(resumed_dir), resume=True)):
        assert max(abs(a - b) for a, b in zip(losses, full_losses[2:])) < 1e-4, (losses, full_losses)
        for name, value in weights.items():
            torch.testing.assert_close(value, full_weights[name], atol=1e-4, rtol=1e-4, msg=name)
