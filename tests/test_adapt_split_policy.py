"""The pipeline re-split's arithmetic (phalanx/adapt_policy.py), on hand-computable cases.

Torch-free. Costs are [embedding, layers..., output] in the units of
`parallel/stage_split.unit_costs`; here small integers so every figure can be checked by hand.
The multi-process run that re-splits against one process is tests/test_adapt_split_training.py.
"""

from __future__ import annotations

import pytest

from phalanx.adapt_policy import (
    RECENT, AdaptRules, SplitGovernor, split_adaptation_refusal, stage_costs, weighted_layer_counts,
)
from phalanx.errors import UserError
from phalanx.parallel.stage_split import balanced_layer_counts

FOUR_LAYERS = (0.0, 1.0, 1.0, 1.0, 1.0, 0.0)


def test_a_stage_three_times_slower_gets_a_third_of_the_layers():
    assert weighted_layer_counts(FOUR_LAYERS, [1.0, 1.0]) == [2, 2]
    assert weighted_layer_counts(FOUR_LAYERS, [1.0, 3.0]) == [3, 1]  # 3 x 1 against 1 x 3
    assert weighted_layer_counts(FOUR_LAYERS, [3.0, 1.0]) == [1, 3]
    # Twice as slow: [3, 1] costs max(3, 2) = 3 and [2, 2] max(2, 4) = 4.
    assert weighted_layer_counts(FOUR_LAYERS, [1.0, 2.0]) == [3, 1]
    # The output's cost counts on the last stage: 2 + 1 = 3 against 2 layers first.
    assert weighted_layer_counts((0.0, 1.0, 1.0, 1.0, 1.0, 1.0), [1.0, 1.0]) == [2, 2]
    assert weighted_layer_counts((0.0, 1.0, 1.0, 1.0, 1.0, 2.0), [1.0, 1.0]) == [3, 1]
    assert stage_costs((0.5, 1.0, 1.0, 1.0, 1.0, 2.0), [3, 1]) == [3.5, 3.0]


def test_equal_speeds_are_the_cost_balanced_split():
    costs = [5.0, 3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 7.0]
    for stages in (2, 3, 4):
        assert balanced_layer_counts(costs, stages) == weighted_layer_counts(costs, [1.0] * stages)
    with pytest.raises(UserError, match="3 pipeline stages need at least 3 layers; the model has 2"):
        weighted_layer_counts([0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0])


def _governor(**rules) -> SplitGovernor:
    """pp=2 over dp=2: global ranks 0, 1 hold stage 0, ranks 2, 3 stage 1; split 2:2."""
    return SplitGovernor((2, 2), FOUR_LAYERS, ranks=[[0, 1], [2, 3]], rules=AdaptRules(window=2, **rules), cost_s=5.0)


def test_a_slow_stage_gives_layers_away_when_the_gain_beats_the_cost():
    """Stage 1 runs 2 layers in 6 s (3 s per layer), stage 0 in 2 s: split 3:1 predicts
    max(3 x 1, 1 x 3) = 3 s, saving 3 s a step; over 10 steps 30 s > 5 s to re-split. A
    pp rank's time is its slowest rank's (rank 3's 6 s, not rank 2's 4 s)."""
    governor = _governor()
    assert governor.observe(1, [2.0, 1.5, 4.0, 6.0], steps_left=10) is None  # the window is not full
    event = governor.observe(2, [2.0, 1.5, 4.0, 6.0], steps_left=10)
    assert event["event"] == "adapt" and event["step"] == 2 and event["split"] == "3:1", event
    assert "6.000 s -> 3.000 s per step, 30.0 s saved over 10 steps against 5.00 s to re-split" in event["reason"]
    assert governor.pending == (3, 1) and governor.counts == (2, 2)
    governor.applied(2.5)
    assert governor.counts == (3, 1) and governor.pending is None and governor.cost_s == 2.5
    # After the re-split the window starts again; the stages' times as predicted: nothing moves.
    assert governor.observe(3, [3.0, 3.0, 3.0, 3.0], steps_left=9) is None
    assert governor.observe(4, [3.0, 3.0, 3.0, 3.0], steps_left=8) is None


def test_no_re_split_when_the_steps_left_do_not_repay_it():
    """The same 3 s a step saved, but one step left: 3 s < 5 s to re-split."""
    governor = _governor()
    governor.observe(1, [2.0, 2.0, 6.0, 6.0], steps_left=1)
    assert governor.observe(2, [2.0, 2.0, 6.0, 6.0], steps_left=1) is None and governor.pending is None
    assert governor.observe(3, [2.0, 2.0, 6.0, 6.0], steps_left=2) is not None  # 6 s > 5 s


def test_hysteresis_keeps_the_split_for_a_small_gain():
    """Stage 1 at 2.4 s, stage 0 at 2 s for 2 layers each (1.2 s and 1 s per layer): 3:1
    predicts max(3 x 1, 1 x 1.2) = 3 s, worse than 2.4 s, so nothing moves. Stage 1 at 6 s:
    3:1 predicts 3 s, 50% below 6 s: moved with a band of 0.5, kept with 0.6."""
    governor = _governor()
    for step in (1, 2, 3):
        assert governor.observe(step, [2.0, 2.0, 2.4, 2.4], steps_left=100) is None
    for band, moves in ((0.6, False), (0.5, True)):
        governor = _governor(band=band)
        governor.observe(1, [2.0, 2.0, 6.0, 6.0], steps_left=100)
        assert (governor.observe(2, [2.0, 2.0, 6.0, 6.0], steps_left=100) is not None) == moves, band


def test_a_split_measured_slower_is_not_returned_to():
    """2:2 measured at 6 s (stage 1 at 3 s per layer): to 3:1 (predicted 3 s). Under 3:1 the
    stages take 6 s and 2 s (2 s and 2 s per layer): the prediction says 2:2 gives 4 s, but 2:2
    was measured at 6 s two steps ago, so the split stays. Past RECENT windows it is predicted
    again (speeds may have moved since)."""
    governor = _governor()
    governor.observe(1, [2.0, 2.0, 6.0, 6.0], steps_left=100)
    assert governor.observe(2, [2.0, 2.0, 6.0, 6.0], steps_left=100)["split"] == "3:1"
    governor.applied(1.0)
    governor.observe(3, [6.0, 6.0, 2.0, 2.0], steps_left=100)
    assert governor.observe(4, [6.0, 6.0, 2.0, 2.0], steps_left=100) is None
    late = 2 + RECENT * 2 + 1  # the window is 2 steps
    governor.observe(late - 1, [6.0, 6.0, 2.0, 2.0], steps_left=100)
    assert governor.observe(late, [6.0, 6.0, 2.0, 2.0], steps_left=100)["split"] == "2:2"


def test_which_layouts_re_split():
    ok = dict(pp=2, schedule="1f1b", replica_groups=1, compile=False, expert_slots=0)
    assert split_adaptation_refusal(**ok) == ""
    assert split_adaptation_refusal(**{**ok, "schedule": "gpipe"}) == ""
    assert split_adaptation_refusal(**{**ok, "pp": 1}) == "one pipeline stage"
    assert "several stages" in split_adaptation_refusal(**{**ok, "schedule": "interleaved"})
    assert "replica groups" in split_adaptation_refusal(**{**ok, "replica_groups": 2})
    assert "--compile" in split_adaptation_refusal(**{**ok, "compile": True})
    assert "expert slots" in split_adaptation_refusal(**{**ok, "expert_slots": 8})
