"""The adaptation policy's arithmetic (phalanx/adapt_policy.py), on hand-computable cases.

Torch-free: shares from speeds, the hysteresis band, the window's median, and naming a slow
rank. The multi-process run that adapts against one process is tests/test_adapt_training.py.
"""

from __future__ import annotations

import pytest

from phalanx.adapt_policy import (
    AdaptRules, ShareGovernor, StragglerWatch, adaptation_refusal, data_parallel_peers, equal_shares, predicted_step_s, proportional_shares,
    share_rows,
)


def test_a_rank_twice_as_fast_gets_twice_the_share():
    assert proportional_shares([2.0, 1.0], 12) == (8, 4)
    assert proportional_shares([1.0, 1.0, 2.0], 16) == (4, 4, 8)
    # 10 x (3, 1) / 4 = (7.5, 2.5): the tie goes to the lower rank
    assert proportional_shares([3.0, 1.0], 10) == (8, 2)
    # the minimum holds: ideal (15.8, 0.2) -> rank 1 keeps 2 (one per micro-batch)
    assert proportional_shares([79.0, 1.0], 16, minimum=2) == (14, 2)
    assert equal_shares(16, 2) == (8, 8) and equal_shares(7, 3) == (3, 2, 2)
    assert [share_rows((6, 2), r) for r in (0, 1)] == [(0, 6), (6, 8)]
    assert predicted_step_s((8, 4), (2.0, 1.0)) == 4.0


def test_shares_change_after_a_window_of_slow_steps_then_hold():
    """Window 3: speeds [2, 1] with shares [6, 6] predict 6 s/step; [8, 4] predict 4 s: 33%
    faster, beyond the 10% band. The change waits for the window, applies once, and the
    window starts again empty."""
    governor = ShareGovernor((6, 6), AdaptRules(window=3, band=0.10))
    assert governor.observe(1, [2.0, 1.0]) is None
    assert governor.observe(2, [2.0, 1.0]) is None
    event = governor.observe(3, [2.0, 1.0])
    assert event["event"] == "adapt" and event["step"] == 3 and event["shares"] == [8, 4]
    assert "6.000 s -> 4.000 s" in event["reason"]
    assert governor.shares == (8, 4) and governor.history == []
    for step in range(4, 10):  # the same speeds: nothing to gain
        assert governor.observe(step, [2.0, 1.0]) is None


def test_hysteresis_keeps_shares_when_speeds_wobble_within_the_band():
    """Shares [8, 4] decided for [2, 1]. Speeds [1.8, 1.2] propose [7, 5] (ideal 7.2, 4.8),
    whose predicted step 5 / 1.2 = 4.17 s is only 6% under the current 8 / 1.8 = 4.44 s:
    within the 10% band, kept. [1.5, 1.5] propose [6, 6]: 4 s against 5.33 s, 25%: changed."""
    governor = ShareGovernor((8, 4), AdaptRules(window=1, band=0.10))
    assert governor.observe(1, [1.8, 1.2]) is None and governor.shares == (8, 4)
    assert governor.observe(2, [1.5, 1.5])["shares"] == [6, 6]


def test_one_slow_step_in_the_window_moves_nothing():
    """The window's median: a single step at a third of the speed does not count."""
    governor = ShareGovernor((6, 6), AdaptRules(window=3))
    for step, speeds in enumerate([[1.0, 1.0], [1.0, 0.33], [1.0, 1.0], [1.0, 1.0]], 1):
        assert governor.observe(step, speeds) is None


def test_a_rank_persistently_slower_is_named_once():
    watch = StragglerWatch(AdaptRules(straggler_margin=0.25, straggler_steps=3))
    assert watch.observe(1, [1.0, 1.6, 1.0]) == []
    assert watch.observe(2, [1.0, 1.1, 1.0]) == []  # back within the margin: the count restarts
    assert watch.observe(3, [1.0, 1.6, 1.0]) == [] and watch.observe(4, [1.0, 1.6, 1.1]) == []
    assert watch.observe(5, [1.0, 1.6, 1.0]) == [
        {"event": "straggler", "step": 5, "rank": 1, "compute_s": 1.6, "median_s": 1.0}]
    assert watch.observe(6, [1.0, 1.6, 1.0]) == []  # said once per slow spell


def test_stragglers_are_judged_against_ranks_doing_the_same_work():
    """dp=2,tp=2,pp=2 (8 ranks): stage 0 is ranks 0-3, its dp replicas the tp pairs {0,1} and
    {2,3}; rank 0's peer is rank 2. A slower pipeline stage (ranks 4-7) is not a straggler."""
    peers = data_parallel_peers(8, dp=2, tp=2)
    assert peers == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert data_parallel_peers(8, dp=2, cp=2, tp=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    watch = StragglerWatch(AdaptRules(straggler_steps=1), peers=peers)
    assert watch.observe(1, [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]) == []
    assert [e["rank"] for e in watch.observe(2, [1.0, 1.0, 1.5, 1.0, 2.0, 2.0, 2.0, 2.0])] == [2]


def test_which_layouts_adapt():
    plain = dict(dp=2, tp=1, pp=1, cp=1, ep=1, sharded=False, replica_groups=1, compile=False, moe=False)
    assert adaptation_refusal(**plain) == ""
    assert "tp=2" in adaptation_refusal(**{**plain, "tp": 2})
    assert "fsdp" in adaptation_refusal(**{**plain, "sharded": True})
    assert "one data-parallel rank" == adaptation_refusal(**{**plain, "dp": 1})
    with pytest.raises(ValueError):
        proportional_shares([1.0, 1.0], 3, minimum=2)
