"""Expert slots weighted by the ranks' speeds (phalanx/balance/speed_weighted.py, the
rebalancer's `speeds`), on hand-computable cases. Torch-free.

A rank's time is its load over its relative speed; the placement evens the times. The run that
trains with such a placement against one process is tests/test_expert_slots_speeds.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from phalanx.adapt_policy import AdaptRules
from phalanx.balance.rebalancer import ExpertRebalancer
from phalanx.balance.solve import rebalance
from phalanx.balance.speed_weighted import place, times
from phalanx.errors import UserError


def _per_rank(row, ranks: int) -> list[list[int]]:
    return [sorted(map(int, part)) for part in np.asarray(row).reshape(ranks, -1)]


def test_a_rank_twice_as_fast_takes_the_two_hottest_experts():
    """Loads [4, 3, 2, 1], two slots per rank. Equal speeds: {4, 1} and {3, 2}, 5 each.
    Rank 1 twice as fast: {2, 1} on rank 0 (time 3) and {4, 3} on rank 1 (7 / 2 = 3.5), where
    list scheduling alone gives {3, 1} and {4, 2} (times 4 and 3): a swap lowers the top to 3.5."""
    load = np.array([[4.0, 3.0, 2.0, 1.0]])
    assert _per_rank(place(load, 4, [1.0, 1.0])[0], 2) == [[0, 3], [1, 2]]
    row = place(load, 4, [1.0, 2.0])
    assert _per_rank(row[0], 2) == [[2, 3], [0, 1]]
    assert times(load, row, np.array([0.5, 1.0])).tolist() == [[6.0, 7.0]]  # relative speeds: 3 / 0.5 and 7 / 1


def test_the_fastest_of_four_ranks_takes_the_hottest_expert():
    """One slot per rank, loads [8, 4, 2, 2], rank 3 twice as fast: expert 0 there (time 4),
    expert 1 on rank 0 (4); the balancer without speeds keeps expert e on rank e (8 on rank 0)."""
    load = np.array([[8.0, 4.0, 2.0, 2.0]])
    assert place(load, 4, [1.0, 1.0, 1.0, 2.0]).tolist() == [[1, 2, 3, 0]]
    assert rebalance(load, 4, 1, 1, 4, policy="global").phy2log.tolist() == [[0, 1, 2, 3]]
    assert rebalance(load, 4, 1, 1, 4, policy="global", speeds=[1, 1, 1, 2]).phy2log.tolist() == [[1, 2, 3, 0]]


def test_extra_replicas_and_a_previous_placement():
    """Loads [6, 2, 2, 2] in 6 slots (3 per rank, rank 1 three times as fast). The balancer's
    replica counts (from the loads: two replicas each of experts 0 and 1) put one replica of
    each of experts 0 and 1 on both ranks, 6 load on each: times 18 and 6. Other counts do
    better: rank 0 {1, 2, 3} and rank 1 {0, 1, 3} (counts [1, 2, 1, 2]): loads 1 + 2 + 1 = 4
    (time 12) and 6 + 1 + 1 = 8 (time 8); 12 is the best of every placement (enumerated by hand
    in a script: each rank 3 distinct experts of 4, every expert at least once).

    A previous placement as even keeps its slots (nothing moves); one less even is replaced,
    each rank's experts that stay keeping their old slots."""
    load = np.array([[6.0, 2.0, 2.0, 2.0]])
    row = place(load, 6, [1.0, 3.0])[0]
    assert all(len(set(r)) == 3 for r in _per_rank(row, 2))  # no rank holds an expert twice
    assert times(load, row[None], np.array([1 / 3, 1.0])).max() == pytest.approx(12.0)
    shuffled = row.reshape(2, 3)[:, ::-1].reshape(-1)
    assert place(load, 6, [1.0, 3.0], previous=shuffled[None])[0].tolist() == shuffled.tolist()
    four = np.array([[8.0, 4.0, 2.0, 2.0]])  # one slot per rank: expert 0 goes to rank 3, the others stay
    assert place(four, 4, [1.0, 1.0, 1.0, 2.0], previous=np.array([[0, 1, 2, 3]])).tolist() == [[1, 2, 3, 0]]
    two = np.array([[4.0, 3.0, 2.0, 1.0]])  # {2, 1} stays on rank 0 in its old slots [1, 2]: ...
    again = place(two, 4, [1.0, 2.0], previous=np.array([[1, 2, 0, 3]]))[0].tolist()
    assert again[:2] == [3, 2] and sorted(again[2:]) == [0, 1], again  # rank 0: 2 keeps slot 1


def test_speeds_are_checked():
    with pytest.raises(UserError, match="rank speeds must be 2 positive numbers"):
        place(np.ones((1, 4)), 4, [1.0, 0.0])
    with pytest.raises(UserError, match="one node only"):
        rebalance(np.ones((1, 4)), 4, 1, 2, 4, speeds=[1, 1, 1, 1])


def test_the_rebalancer_weights_by_speeds_beyond_the_band():
    """Loads [8, 4, 2, 2] over 4 ep ranks, one slot each, re-planned every step, a window of 2
    steps. Speeds within 10% of each other count as equal (the balancer's usual placement, no
    `speeds` in the row); rank 3 at twice the others' speed takes expert 0 (the others move one
    rank down) once the window is full; one fast step in the window's median moves nothing."""
    rules = AdaptRules(window=2)
    equal = ExpertRebalancer([[0, 1, 2, 3]], 4, 4, every=1, slot_bytes=1, decay=0.0, speed_rules=rules)
    for step in (1, 2):
        event = equal.observe(step, [[8, 4, 2, 2]], speeds=[1.0, 1.0, 1.05, 1.0])
        assert "speeds" not in event.row() and event.moved_slots == 0 and equal.phy2log.tolist() == [[0, 1, 2, 3]]
    fast = ExpertRebalancer([[0, 1, 2, 3]], 4, 4, every=1, slot_bytes=1, decay=0.0, speed_rules=rules)
    assert "speeds" not in fast.observe(1, [[8, 4, 2, 2]], speeds=[10.0, 10.0, 10.0, 20.0]).row()  # window not full
    spike = ExpertRebalancer([[0, 1, 2, 3]], 4, 4, every=1, slot_bytes=1, decay=0.0, speed_rules=AdaptRules(window=3))
    for step, speeds in enumerate(([1, 1, 1, 1], [1, 1, 1, 2], [1, 1, 1, 1]), start=1):
        assert "speeds" not in spike.observe(step, [[8, 4, 2, 2]], speeds=speeds).row()
    event = fast.observe(2, [[8, 4, 2, 2]], speeds=[10.0, 10.0, 10.0, 20.0])
    assert fast.phy2log.tolist() == [[1, 2, 3, 0]] and event.moved_slots == 4
    row = event.row()
    assert row["speeds"] == [0.5, 0.5, 0.5, 1.0]
    # Before: times [16, 8, 4, 2], mean 7.5: (16 - 7.5) / 7.5. After: [8, 4, 4, 8], mean 6: 1/3.
    assert row["imbalance_before"] == pytest.approx(8.5 / 7.5) and row["imbalance_after"] == pytest.approx(1 / 3)
    assert fast.state_dict()["speeds"] == [[0.5, 0.5, 0.5, 1.0]] * 2
    unweighted = ExpertRebalancer([[0, 1, 2, 3]], 4, 4, every=1, slot_bytes=1, decay=0.0)  # no speed_rules: loads alone
    unweighted.observe(1, [[8, 4, 2, 2]], speeds=[10.0, 10.0, 10.0, 20.0])
    assert unweighted.phy2log.tolist() == [[0, 1, 2, 3]] and unweighted.speeds == []
