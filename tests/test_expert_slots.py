"""Slot placement and slot routing (`phalanx.parallel.expert_slots`), one process.

Everything here is integer bookkeeping, compared exactly: counts, slot ids, ranks. The
proportions test compares the rows each replica gets with the weights' shares: the split by
position rounds each replica's share of n rows to within one row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phalanx.errors import UserError
from phalanx.parallel.expert_slots import SlotPlacement, SlotRouter, routing_table, routing_weights


def _sorted_counts(n_experts: int, n_rows: int, seed: int) -> torch.Tensor:
    experts = torch.randint(0, n_experts, (n_rows,), generator=torch.Generator().manual_seed(seed))
    return torch.bincount(experts, minlength=n_experts)


@pytest.mark.parametrize("n_experts, ep", [(8, 1), (8, 2), (8, 4), (64, 8), (6, 3)])
def test_one_slot_per_expert_is_todays_layout(n_experts, ep):
    placement = SlotPlacement.one_per_expert(n_experts, ep, node_size=1)
    n_local = n_experts // ep
    # Today's mapping (parallel/expert.py, shard_experts): expert e lives on rank e // n_local.
    np.testing.assert_array_equal(placement.rank_of_slot()[list(placement.slot_expert)], np.arange(n_experts) // n_local)
    for rank in range(ep):
        assert [placement.slot_expert[s] for s in placement.local_slots(rank)] == list(range(rank * n_local, (rank + 1) * n_local))
        counts = _sorted_counts(n_experts, 50, seed=rank)
        slots, order, slot_counts = SlotRouter(placement, rank, np.arange(1, n_experts + 1)).route(counts, 50)
        # Every row keeps its expert as its slot, order is the identity: dispatch sees today's input.
        assert torch.equal(slot_counts, counts)
        assert torch.equal(order, torch.arange(50))
        assert torch.equal(slots, torch.repeat_interleave(torch.arange(n_experts), counts))


def _replicated() -> SlotPlacement:
    # 4 experts, 8 slots on ep=4 (2 per rank), nodes of 2 ranks: {0, 1} and {2, 3}.
    # expert 0: slots 0 (rank 0), 2 (rank 1), 6 (rank 3); expert 1: slots 1 (rank 0), 4 (rank 2);
    # expert 2: slots 3 (rank 1), 7 (rank 3); expert 3: slot 5 (rank 2).
    return SlotPlacement.from_slots([0, 1, 0, 2, 1, 3, 0, 2], n_experts=4, ep=4, node_size=2)


@pytest.mark.parametrize("rank", range(4))
def test_counts_sum_and_every_row_reaches_its_expert(rank):
    placement = _replicated()
    counts = _sorted_counts(4, 97, seed=10 + rank)
    load = np.array([5.0, 3.0, 2.0, 1.0])
    slots, order, slot_counts = SlotRouter(placement, rank, load).route(counts, 97)
    experts = torch.repeat_interleave(torch.arange(4), counts)
    held = torch.tensor(placement.slot_expert)
    assert torch.equal(held[slots], experts)  # each row's slot holds the row's expert
    assert int(slot_counts.sum()) == 97
    assert torch.equal(slot_counts, torch.bincount(slots, minlength=8))
    # Per expert, the slot counts add up to the expert's count.
    assert torch.equal(torch.zeros(4, dtype=torch.long).index_add_(0, held, slot_counts), counts)
    # `order` sorts the rows by slot, stably: slot-major, ranks in order, as dispatch needs.
    assert sorted(order.tolist()) == list(range(97))
    sent = slots[order]
    assert torch.all(sent[1:] >= sent[:-1])
    for slot in range(8):
        picked = order[sent == slot]
        assert torch.all(picked[1:] > picked[:-1])


def test_own_rank_then_own_node_then_everyone():
    placement = _replicated()
    slot_rank = placement.rank_of_slot()
    for rank in range(4):
        candidates, bounds = routing_table(placement, rank, [5.0, 3.0, 2.0, 1.0])
        used = {e: {int(s) for s, b in zip(candidates[e], bounds[e]) if b <= 1.0} for e in range(4)}
        node = rank // 2
        for expert in range(4):
            replicas = [s for s, e in enumerate(placement.slot_expert) if e == expert]
            own = [s for s in replicas if slot_rank[s] == rank]
            near = [s for s in replicas if slot_rank[s] // 2 == node]
            assert used[expert] == set(own or near or replicas), (rank, expert)
    # Spelled out: rank 2 (node 1) has no replica of expert 2 on itself, one on rank 3 (node 1).
    assert set(routing_table(placement, 2)[0][2]) == {7}
    # Rank 0 (node 0) has no replica of expert 3 on its node: it sends to slot 5 on node 1.
    assert set(routing_table(placement, 0)[0][3]) == {5}


def test_node_local_rows_never_cross_nodes():
    placement = _replicated()
    counts = torch.tensor([40, 30, 20, 10])
    for rank in range(4):
        slots, _, _ = SlotRouter(placement, rank).route(counts, 100)
        dest_node = torch.as_tensor(placement.rank_of_slot())[slots] // 2
        crossing = torch.repeat_interleave(torch.arange(4), counts)[dest_node != rank // 2]
        # Only expert 3 (one replica, on node 1) may leave node 0; node 1 holds every expert.
        assert set(crossing.tolist()) <= ({3} if rank < 2 else set())


def test_remote_proportions_follow_loads():
    # 3 experts on ep=3, one rank per node: expert 0 on ranks 1 and 2, source rank 0 has none.
    placement = SlotPlacement.from_slots([1, 2, 0, 2, 0, 1], n_experts=3, ep=3, node_size=1)
    # Predicted rank loads: rank 1 carries 10/2 + 6/2 = 8 (slots 2, 3 hold experts 0 and 2),
    # rank 2 carries 10/2 + 2/2 = 6 (slots 4, 5 hold experts 0 and 1).
    load = np.array([10.0, 2.0, 6.0])
    np.testing.assert_allclose(placement.rank_loads(load), [2 / 2 + 6 / 2, 8.0, 6.0])
    weights = routing_weights(placement, load)
    np.testing.assert_allclose(weights[[2, 4]], [1 / 8, 1 / 6])
    n = 700
    slots, _, slot_counts = SlotRouter(placement, 0, load).route(torch.tensor([n, 0, 0]), n)
    share_rank2 = (1 / 6) / (1 / 8 + 1 / 6)  # = 4/7: the lighter rank gets more
    assert int(slot_counts[4]) == round(n * share_rank2) == 400
    assert int(slot_counts[2]) == n - 400
    # Without loads the split is even; a different load average changes it (every rank computes
    # the same proportions from the same average, so nothing is exchanged).
    even = SlotRouter(placement, 0).route(torch.tensor([n, 0, 0]), n)[2]
    assert even[2] == even[4] == n // 2


def test_same_inputs_same_routes():
    placement = _replicated()
    counts = _sorted_counts(4, 61, seed=3)
    a = SlotRouter(placement, 2, [1.0, 2.0, 3.0, 4.0]).route(counts, 61)
    b = SlotRouter(placement, 2, [1.0, 2.0, 3.0, 4.0]).route(counts, 61)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_empty_batch_and_empty_expert():
    placement = _replicated()
    slots, order, slot_counts = SlotRouter(placement, 1).route(torch.zeros(4, dtype=torch.long), 0)
    assert slots.numel() == order.numel() == 0 and slot_counts.tolist() == [0] * 8


@pytest.mark.parametrize("slot_expert, n_experts, ep, node_size, message", [
    ([0, 1, 2], 4, 1, None, "fewer slots than the 4 experts"),
    ([0, 1, 2, 3, 0], 4, 2, None, "not a multiple of ep=2"),
    ([0, 1, 2, 2], 4, 2, None, "no slot holds expert 3"),
    ([0, 1, 2, 7], 4, 2, None, "outside 0..3"),
    ([0, 0, 1, 2, 3, 1], 4, 3, None, "ep rank 0 holds two slots of one expert"),
    ([0, 1, 2, 3, 0, 1], 4, 3, 2, "node size 2 must be at least 1 and divide ep=3"),
])
def test_bad_placements_are_user_errors(slot_expert, n_experts, ep, node_size, message):
    with pytest.raises(UserError, match=message):
        SlotPlacement.from_slots(slot_expert, n_experts, ep, node_size)


def test_bad_source_rank():
    with pytest.raises(UserError, match="source rank 4 is outside the ep group of 4"):
        routing_table(_replicated(), 4)
