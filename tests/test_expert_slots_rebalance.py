"""Load average, rebalance decision and its event row (`phalanx.balance.rebalancer`), torch-free.

The figures of the event row are recomputed here by hand from the same loads (the moving
average written out, the balancer's measures applied to the placements before and after); the
numpy arithmetic is the same, so they must agree to float rounding (1e-12 relative).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from phalanx.balance import measure
from phalanx.balance.solve import rebalance
from phalanx.errors import UserError
from phalanx.balance.slot_copies import copy_sources, remote_copies
from phalanx.balance.rebalancer import ExpertRebalancer, initial_placement, loads_from_record

LAYERS, EXPERTS, SLOTS, EP = 2, 8, 12, 4


def _skewed_steps(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    hot = np.array([40.0, 20, 8, 4, 2, 1, 1, 1])  # expert 0 takes a third of the tokens
    return [rng.poisson(hot * 10, size=(LAYERS, EXPERTS)).astype(float) for _ in range(n)]


def test_event_row_matches_a_hand_computation():
    start = initial_placement(LAYERS, EXPERTS, SLOTS, EP)
    rebalancer = ExpertRebalancer(start, EXPERTS, EP, every=3, slot_bytes=1000, decay=0.5)
    steps = _skewed_steps(6)
    events = {step: rebalancer.observe(step, tokens) for step, tokens in enumerate(steps, start=1)}
    assert [s for s, e in events.items() if e is not None] == [3, 6]  # every K-th step only

    average = steps[0]
    for tokens in steps[1:3]:
        average = 0.5 * average + 0.5 * tokens
    event = events[3]
    assert list(event.row()) == ["event", "step", "imbalance_before", "imbalance_after", "moved_slots", "bytes_moved"]
    assert event.row()["event"] == "rebalance" and event.step == 3
    # The balancer's incremental solver, fed the previous placement, gives the new one.
    expected = rebalance(average, SLOTS, 1, 1, EP, policy="global", previous=start).phy2log
    # `rebalancer` has moved on (step 6); replay steps 1-3 to see step 3's placement.
    replay = ExpertRebalancer(start, EXPERTS, EP, every=3, slot_bytes=1000, decay=0.5)
    for step, tokens in enumerate(steps[:3], start=1):
        replay.observe(step, tokens)
    np.testing.assert_array_equal(replay.phy2log, expected)
    before = measure.imbalance(measure.gpu_loads(average, start, EP)).mean()
    after = measure.imbalance(measure.gpu_loads(average, expected, EP)).mean()
    assert event.imbalance_before == pytest.approx(before, rel=1e-12)
    assert event.imbalance_after == pytest.approx(after, rel=1e-12)
    assert event.moved_slots == int((expected != start).sum())
    assert event.bytes_moved == remote_copies(start, expected, EP) * 1000
    # On a skewed router the planned placement is much more even than the first one.
    assert event.imbalance_after < 0.5 * event.imbalance_before


def test_measured_rank_loads_are_the_before_figure():
    rebalancer = ExpertRebalancer(initial_placement(1, 4, 4, 2), 4, 2, every=2, slot_bytes=8, decay=0.5)
    rebalancer.observe(1, [[4.0, 3, 2, 1]], rank_tokens=[[10.0, 2.0]])
    event = rebalancer.observe(2, [[4.0, 3, 2, 1]], rank_tokens=[[6.0, 6.0]])
    # Average of the measured arrivals: [8, 4]; (max - mean) / mean = (8 - 6) / 6.
    assert event.imbalance_before == pytest.approx(1 / 3, rel=1e-12)


def test_no_move_without_a_predicted_gain_and_the_measure_restarts_after_one():
    start = initial_placement(1, 4, 4, 2)
    rebalancer = ExpertRebalancer(start, 4, 2, every=1, slot_bytes=8, decay=0.5)
    # Measured arrivals already even (1/2 each): nothing the balancer could promise beats that.
    event = rebalancer.observe(1, [[4.0, 3, 2, 1]], rank_tokens=[[5.0, 5.0]])
    assert (event.moved_slots, event.bytes_moved) == (0, 0)
    assert event.imbalance_after == event.imbalance_before == 0
    np.testing.assert_array_equal(rebalancer.phy2log, start)
    # Skewed arrivals: the move is made, and the next decision measures only the new placement.
    event = rebalancer.observe(2, [[4.0, 3, 2, 1]], rank_tokens=[[10.0, 0.0]])
    assert event.moved_slots > 0 and event.imbalance_after < event.imbalance_before
    assert rebalancer.rank_load is None
    event = rebalancer.observe(3, [[4.0, 3, 2, 1]], rank_tokens=[[6.0, 4.0]])
    assert event.imbalance_before == pytest.approx(0.2, rel=1e-12)  # (6 - 5) / 5, not mixed with [10, 0]


def test_loads_from_the_trainers_moe_record():
    # dp=4 as edp=2 x ep=2: dp ranks 0, 2 are ep rank 0; 1, 3 are ep rank 1. Layers "3" and "1".
    record = {
        "3": {"expert_tokens": [5, 6, 7, 8], "rank_tokens": [1, 2, 10, 20]},
        "1": {"expert_tokens": [1, 2, 3, 4], "rank_tokens": [3, 4, 30, 40]},
    }
    experts, ranks = loads_from_record(record, ep=2)
    np.testing.assert_array_equal(experts, [[1, 2, 3, 4], [5, 6, 7, 8]])
    np.testing.assert_array_equal(ranks, [[33, 44], [11, 22]])
    with pytest.raises(UserError, match="4 dp ranks, not a multiple of ep=3"):
        loads_from_record(record, ep=3)


def test_initial_placement():
    np.testing.assert_array_equal(initial_placement(3, 8, 8, 4), np.tile(np.arange(8), (3, 1)))  # today's layout
    wide = initial_placement(2, 8, 16, 4)
    assert wide.shape == (2, 16)
    assert (measure.replica_counts(wide, 8) >= 1).all()
    assert measure.two_replicas_on_one_gpu(wide, 4).sum() == 0


def test_copy_sources_by_hand():
    # ep=2, 3 slots per rank. Old: rank 0 [0, 1, 2], rank 1 [3, 0, 1].
    old = np.array([0, 1, 2, 3, 0, 1])
    new = np.array([0, 3, 1, 3, 2, 2])
    source = copy_sources(old, new, 2)
    # slot 0 unchanged; slot 1 takes expert 3 from rank 1's slot 3 (remote); slot 2 takes expert
    # 1 from slot 1 on its own rank (local); slot 3 unchanged; slots 4 and 5 take expert 2,
    # held only by slot 2 (remote, both).
    assert source.tolist() == [0, 3, 1, 3, 2, 2]
    assert remote_copies(old, new, 2) == 3


def test_remote_copies_take_turns_over_the_old_replicas():
    old = np.array([0, 1, 0, 2, 3, 4])  # ep=3, 2 per rank: expert 0 on ranks 0 and 1
    new = np.array([1, 3, 2, 4, 0, 0])  # expert 0 leaves ranks 0 and 1 for two slots of rank 2
    # (copy_sources does not judge a placement; SlotPlacement forbids two on one rank)
    source = copy_sources(old, new, 3)
    assert source[[4, 5]].tolist() == [0, 2]  # the first copy reads slot 0, the second slot 2


def test_state_dict_resumes_the_same_plan():
    steps = _skewed_steps(4, seed=1)
    start = initial_placement(LAYERS, EXPERTS, SLOTS, EP)
    straight = ExpertRebalancer(start, EXPERTS, EP, every=2, slot_bytes=4)
    events = [straight.observe(step, t) for step, t in enumerate(steps, start=1)]
    first = ExpertRebalancer(start, EXPERTS, EP, every=2, slot_bytes=4)
    for step, tokens in enumerate(steps[:3], start=1):
        first.observe(step, tokens)
    resumed = ExpertRebalancer(start, EXPERTS, EP, every=2, slot_bytes=4)
    resumed.load_state_dict(first.state_dict())
    assert resumed.observe(4, steps[3]) == events[3]
    np.testing.assert_array_equal(resumed.phy2log, straight.phy2log)


def test_bad_input():
    start = initial_placement(1, 4, 4, 2)
    with pytest.raises(UserError, match="--rebalance-every=0 must be at least 1"):
        ExpertRebalancer(start, 4, 2, every=0, slot_bytes=1)
    rebalancer = ExpertRebalancer(start, 4, 2, every=1, slot_bytes=1)
    with pytest.raises(UserError, match=r"expert loads of shape \(1, 3\), expected \(1, 4\)"):
        rebalancer.observe(1, [[1.0, 2.0, 3.0]])
    with pytest.raises(UserError, match=r"rank loads of shape \(1, 3\), expected \(1, 2\)"):
        rebalancer.observe(1, [[1.0, 2.0, 3.0, 4.0]], rank_tokens=[[1.0, 2.0, 3.0]])
    with pytest.raises(UserError, match="the checkpoint's expert placement is"):
        rebalancer.load_state_dict({"phy2log": [[0, 1, 2, 3, 0, 1]], "expert_load": None, "rank_load": None})
    with pytest.raises(UserError, match="expert 3 has no slot in the old placement"):
        copy_sources([0, 1, 2, 2], [0, 1, 2, 3], 2)


def test_imports_no_torch():
    code = "import sys, phalanx.balance.rebalancer; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
