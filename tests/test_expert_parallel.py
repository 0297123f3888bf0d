"""Expert-parallel layouts train the tiny-moe model exactly as one process does.

Each layout reads the same global batch per step and starts from the same full weights (each
ep rank keeps its experts' rows of the single-process stacks). Routing is dropless and
decided per token, so every token visits the same experts with the same weights as in one
process; all-to-all moves rows without arithmetic. What can differ is float summation
order: an expert's matmul sees its rows from several ranks in another order, the weight
gradient sums them (and then the edp/dp reduction sums ranks) in another order, and the
global gradient norm adds per-mesh partial norms. That is ~1e-7 relative per op; over 3 AdamW
steps it stays below 1e-5 on losses and weights here, and TOLERANCE = 1e-4 leaves margin. A
real bug moves far more: expert gradients divided by edp instead of dp, or the bias updated
from one rank's counts, showed errors of 1e-3 to 1e-2 when tried while this was written. The
gradient norm is compared too (relative 1e-4): a rank that leaves the other ranks' experts out
of it still matches the weights, because AdamW almost ignores the clip factor.

Routing ties could make a layout pick another expert than one process (top-k of equal
scores); with random fp32 gate weights they do not happen in these runs, and any flip would
show as a failure, not pass silently.
"""

from __future__ import annotations

import pytest

from phalanx.model import config as model_config_module
from phalanx.testing.fork_ranks import run_ranks
from tests.moe_runs import TOLERANCE, check_load_records, compare, expert_counts, run_and_gather

# The layouts in phalanx's grammar, where ep is carved out of dp: "ep=2" is dp=2,ep=2
# (one ep group), "dp=2,ep=2" is two ep groups of 2 (dp=4), "ep=2 with FSDP" is fsdp=true.
LAYOUTS = {
    "ep=2": "dp=2,ep=2",
    "ep=4": "dp=4,ep=4",
    "dp=2,ep=2": "dp=4,ep=2",
    "ep=2,fsdp": "dp=2,ep=2,fsdp=true",
    "dp=2,ep=2,fsdp,microbatches=2": "dp=4,ep=2,fsdp=true,microbatches=2",
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_single_process(moe_config, moe_reference, layout):
    plan = LAYOUTS[layout]
    world = int(plan.split(",")[0].split("=")[1])
    # One layout draws the plots (the suite's other runs leave them off: --no-plot).
    cfg = moe_config.replace(plan=plan, out=f"{moe_config.out}-{layout}", plot=layout == next(iter(LAYOUTS)))
    compare(run_ranks(world, run_and_gather, cfg), moe_reference)
    check_load_records(cfg, dp=world)


@pytest.mark.parametrize("plan", ["dp=2,ep=2,tp=2", "dp=2,ep=2,pp=2"])
def test_with_tensor_and_pipeline_parallelism(moe_config, moe_reference, plan):
    """ep inside tp (attention split over tp, experts whole on each tp rank) and inside
    pipeline stages (each stage routes its own layers over its own ep group).

    The load records must hold every MoE layer, also under pp where rank 0 holds only the
    first stage's layers, and each expert's count must equal one process's exactly: routing
    is the same token by token (that is what the loss/weight comparison relies on), and
    counts are integers, so there is no tolerance to argue about.
    """
    cfg = moe_config.replace(plan=plan, out=f"{moe_config.out}-{plan}")
    compare(run_ranks(4, run_and_gather, cfg), moe_reference)
    check_load_records(cfg, dp=2)
    assert expert_counts(cfg.out) == expert_counts(moe_config.out + "-ref")


def test_sigmoid_router_with_loss_free_bias(monkeypatch, moe_config):
    """The DeepSeek-V3 router under ep: the bias update uses the step's counts summed over all
    dp ranks, so biases (and hence routing) stay identical to one process. Same tolerance
    argument as above; a bias updated from local counts diverges visibly by step 3. A large
    rate makes the bias change routing within these few steps (checked: not all zero)."""
    cfg = model_config_module.PRESETS["tiny-moe"].replace(router="sigmoid", router_bias_rate=0.05)
    monkeypatch.setitem(model_config_module.PRESETS, "tiny-moe", cfg)  # forked ranks inherit it
    reference = run_ranks(1, run_and_gather, moe_config.replace(out=moe_config.out + "-sigmoid-ref"))[0]
    assert reference[1]["layers.0.feed_forward.router.expert_bias"].abs().sum() > 0
    cfg = moe_config.replace(plan="dp=2,ep=2,microbatches=2", out=moe_config.out + "-sigmoid")
    compare(run_ranks(2, run_and_gather, cfg), reference)


@pytest.mark.parametrize("extra", ["", ",recompute=full", ",schedule=zbv"])
def test_aux_losses_under_pipeline_parallelism(monkeypatch, moe_config, moe_reference, extra):
    """Balance and z losses on: dp=2,ep=2,pp=2 trains as dp=2,ep=2 with the same micro-batches.

    Both compute each aux loss per rank and per micro-batch (2 of a dp rank's 4 sequences),
    so the losses are the same numbers; the pipeline puts their gradients into each stage's
    backward (`moe_aux_loss.aux_losses_in_backward`) where the flat loop adds them to the loss.
    The micro-batch count is set on both because pp's default is 2 x pp = 4, and the balance
    loss of 1-sequence micro-batches is another number (f_e * p_e is not linear in the tokens;
    the z-loss, a plain mean, would still match). Neither is one process's aux loss, which
    sees all 8 sequences in one forward: hence the comparison with the non-pipelined layout.
    Same tolerance argument as above. The coefficients are large so that losing the aux
    gradient of either stage moves the weights far past the tolerance (checked below against
    the run without aux losses; with the hook removed this test fails at the first norm).
    With recompute=full the blocks' forwards run again in backward; the aux gradient must
    enter once (and the recomputation must save the same tensors as the first forward).
    zbv splits backward into an input pass and a later weight pass: the aux gradient must
    reach the routers' weights through the latter, and the experts' weights must be found
    by it at all (they were not while FSDP resharded them after forward).
    """
    cfg = model_config_module.PRESETS["tiny-moe"].replace(aux_loss_coef=0.1, z_loss_coef=0.01)
    monkeypatch.setitem(model_config_module.PRESETS, "tiny-moe", cfg)  # forked ranks inherit it
    flat = run_ranks(2, run_and_gather, moe_config.replace(plan="dp=2,ep=2,microbatches=2", out=f"{moe_config.out}-aux-flat{extra}"))
    piped = run_ranks(4, run_and_gather, moe_config.replace(plan="dp=2,ep=2,pp=2,microbatches=2" + extra, out=f"{moe_config.out}-aux-pp{extra}"))
    compare(piped, flat[0])
    for layer in range(4):  # each stage's aux gradient matters: both moved the routers
        name = f"layers.{layer}.feed_forward.router.gate.weight"
        assert (flat[0][1][name] - moe_reference[1][name]).abs().max() > 10 * TOLERANCE, name
