"""Moving slots and summing replica gradients over 2 and 4 gloo ranks, against references
every rank rebuilds from shared seeds. Tolerance 0 throughout:

* a move only copies rows (no arithmetic), so every slot must hold exactly its new expert's
  numbers, in every dtype, weights and AdamW moments alike;
* the replica sums use integer-valued float64 gradients (|values| < 2^20, a few terms), whose
  sums are exact in any order, so the all-reduce must match the hand-built sum bit for bit.

Placements are random (every rank draws the same ones from one seed), with replicas, with
moves that stay on a rank, cross ranks, and none at all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from phalanx.errors import UserError
from phalanx.parallel.expert_slot_grads import counted_once, sum_replica_grads, sum_replica_param_grads
from phalanx.parallel.expert_slot_moves import MOVING_STATE, move_expert_slots, move_slots, slot_bytes
from phalanx.parallel.expert_slots import SlotPlacement
from phalanx.testing.fork_ranks import run_ranks


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-for-bit equality (torch.equal; `assert_close`'s first call costs seconds of imports per fork)."""
    assert got.dtype == want.dtype and torch.equal(got, want), f"got {got} want {want}"


def random_slots(rng: np.random.Generator, n_experts: int, ep: int, per_rank: int) -> np.ndarray:
    """(ep * per_rank,) a valid placement: every expert somewhere, no rank holding one twice."""
    while True:
        slots = np.concatenate([rng.choice(n_experts, per_rank, replace=False) for _ in range(ep)])
        if np.unique(slots).size == n_experts:
            return slots


def _expert_rows(n_experts: int, seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """(experts, *shape): the contents of each expert, identical in all its replicas."""
    return torch.randn(n_experts, *shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _local(contents: torch.Tensor, slots: np.ndarray, rank: int, ep: int) -> torch.Tensor:
    per_rank = len(slots) // ep
    return contents[torch.as_tensor(slots[rank * per_rank : (rank + 1) * per_rank])].clone()


def _check_moves() -> int:
    rank, ep = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(1234 + ep)
    cases = []
    for n_experts, per_rank in ((4, 2), (6, 3), (5, 5)):
        old = random_slots(rng, n_experts, ep, per_rank)
        cases += [(n_experts, old, random_slots(rng, n_experts, ep, per_rank)), (n_experts, old, old.copy())]
    # Today's layout to a replicated one (what the first rebalance of a run does).
    cases.append((8, np.arange(8), random_slots(rng, 8, ep, 8 // ep)))
    for case, (n_experts, old, new) in enumerate(cases):
        contents = [
            _expert_rows(n_experts, 10 * case, torch.float32, (3, 2)),
            _expert_rows(n_experts, 10 * case + 1, torch.bfloat16, (2,)),
            _expert_rows(n_experts, 10 * case + 2, torch.float32, (2, 3)),
        ]
        moved = move_slots([_local(c, old, rank, ep) for c in contents], old, new)
        if case == 0:  # a stack of the wrong height: an error on every rank, before any collective
            with pytest.raises(UserError, match="a slot tensor has 3 rows, but this rank holds 2 slots"):
                move_slots([torch.zeros(3, 2)], old, new)
        for got, c in zip(moved, contents):
            _same(got, _local(c, new, rank, ep))
    return len(cases)


def _check_module_and_adamw() -> None:
    """Weights and AdamW moments move in place; the step count stays; one slot's bytes."""
    rank, ep = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(99)
    n_experts, per_rank = 6, 3
    old, new = random_slots(rng, n_experts, ep, per_rank), random_slots(rng, n_experts, ep, per_rank)
    weights = [_expert_rows(n_experts, seed, torch.float32, (4, 2)) for seed in (1, 2)]
    params = [torch.nn.Parameter(_local(w, old, rank, ep)) for w in weights]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    moments = {}
    for i, param in enumerate(params):
        # The state AdamW holds after one step (`test_adamw_state_is_what_moves` checks the
        # names and shapes in one process; a real step here would pay torch's lazy imports
        # in every forked rank), with expert-specific moments, as identical replicas have.
        optimizer.state[param]["step"] = torch.tensor(1.0)
        for j, key in enumerate(("exp_avg", "exp_avg_sq")):
            moments[i, key] = _expert_rows(n_experts, 100 + 10 * i + j, torch.float32, (4, 2)).abs()
            optimizer.state[param][key] = _local(moments[i, key], old, rank, ep)
    state_ids = {(i, k): id(optimizer.state[p][k]) for i, p in enumerate(params) for k in ("exp_avg", "exp_avg_sq")}
    move_expert_slots(params, optimizer, old, new)
    for i, param in enumerate(params):
        _same(param.detach(), _local(weights[i], new, rank, ep))
        for key in ("exp_avg", "exp_avg_sq"):
            _same(optimizer.state[param][key], _local(moments[i, key], new, rank, ep))
            assert id(optimizer.state[param][key]) == state_ids[i, key]  # same objects, moved in place
        assert float(optimizer.state[param]["step"]) == 1.0
    # One slot: 2 weights of 4 x 2 float32, each with two float32 moments.
    assert slot_bytes(params, optimizer) == 2 * 8 * 4 * 3


def _grads(rank: int, slots: np.ndarray, ep: int, seed: int) -> list[torch.Tensor]:
    """This rank's slot gradients: integer-valued float64, distinct per (rank, slot)."""
    per_rank = len(slots) // ep
    generator = torch.Generator().manual_seed(seed + rank)
    return [torch.randint(-(2**20), 2**20, (per_rank, *shape), generator=generator).double() for shape in ((3, 2), (5,))]


def _check_replica_sums() -> None:
    rank, ep = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(7 + ep)
    cases = [(n, random_slots(rng, n, ep, per)) for n, per in ((4, 2), (6, 3), (3, 3))] + [(8, np.arange(8))]
    for case, (n_experts, slots) in enumerate(cases):
        placement = SlotPlacement.from_slots(slots, n_experts, ep)
        grads = _grads(rank, slots, ep, 50 * case)
        sum_replica_grads(grads, placement)
        every = [_grads(r, slots, ep, 50 * case) for r in range(ep)]  # all ranks' gradients before the sum
        stacked = [torch.cat([g[i] for g in every]) for i in range(2)]  # (S, ...) in slot order
        for i, got in enumerate(grads):
            for local, slot in enumerate(placement.local_slots(rank)):
                replicas = np.flatnonzero(slots == slots[slot])
                _same(got[local], stacked[i][torch.as_tensor(replicas)].sum(0))
        if case == len(cases) - 1:  # one slot per expert: untouched
            for got, before in zip(grads, every[rank]):
                assert torch.equal(got, before)
    # Through .grad, with a parameter that got none (counts as zero).
    placement = SlotPlacement.from_slots(cases[0][1], 4, ep)
    params = [torch.nn.Parameter(torch.zeros(placement.slots_per_rank, 2)) for _ in range(2)]
    params[0].grad = torch.full((placement.slots_per_rank, 2), float(rank + 1))
    sum_replica_param_grads(params, placement)
    replicas = placement.replicas()[list(placement.slot_expert[s] for s in placement.local_slots(rank))]
    assert torch.equal(params[1].grad, torch.zeros_like(params[1]))
    for local, slot in enumerate(placement.local_slots(rank)):
        holders = np.flatnonzero(cases[0][1] == cases[0][1][slot]) // placement.slots_per_rank
        expected = float(sum(h + 1 for h in holders)) if replicas[local] > 1 else float(rank + 1)
        assert params[0].grad[local].tolist() == [expected, expected]


def _all() -> int:
    cases = _check_moves()
    _check_module_and_adamw()
    _check_replica_sums()
    return cases


@pytest.mark.parametrize("world", [2, 4])
def test_moves_and_replica_sums(world):
    # Constructing an optimizer imports torch._dynamo (seconds): once here, before the fork,
    # rather than once in every rank.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    assert run_ranks(world, _all, timeout_s=90) == [7] * world


def test_counted_once_marks_one_slot_per_expert():
    placement = SlotPlacement.from_slots([0, 1, 0, 2, 1, 3, 0, 2], n_experts=4, ep=4)
    marks = np.concatenate([counted_once(placement, rank) for rank in range(4)])
    assert marks.tolist() == [True, True, False, True, False, True, False, False]
    held = np.asarray(placement.slot_expert)
    assert sorted(held[marks].tolist()) == [0, 1, 2, 3]


def test_adamw_state_is_what_moves():
    """The names `move_expert_slots` moves are AdamW's per-element state, shaped like the weight."""
    param = torch.nn.Parameter(torch.ones(3, 2, 2))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones_like(param)
    optimizer.step()
    state = optimizer.state[param]
    assert set(MOVING_STATE) <= set(state) and all(state[k].shape == param.shape for k in MOVING_STATE)
    assert state["step"].numel() == 1  # one count per parameter: it does not move
    assert slot_bytes([param], optimizer) == 4 * 4 * 3
