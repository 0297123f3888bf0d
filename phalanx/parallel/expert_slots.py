"""Physical expert slots over an ep group (`--expert-slots S`), and how a token picks its slot.

Today rank i of an ep group holds experts [i * E/ep, (i+1) * E/ep). With slots, the ep group
holds S >= E physical slots, S/ep per rank, rank i holding slots [i * S/ep, (i+1) * S/ep);
each slot holds one expert (a hot expert may be held by several slots: replicas). One slot per
expert in order (`SlotPlacement.one_per_expert`) is today's layout exactly: slot e = expert e.

Routing must add no collective: every rank of the ep group holds the same placement and the
same load average (`phalanx.balance.rebalancer`), so every rank computes the same routing
tables. For a token on source rank r routed to expert e (`SlotRouter`):
  1. r holds a replica of e: that one (the rows never leave the rank);
  2. else some ranks of r's node hold one: those, in fixed proportions (below);
  3. else all replicas of e, in fixed proportions.
The proportions send more to replicas on ranks that are predicted to carry less (weight 1 /
predicted rank load under the balancer's model, a replica carrying load/replicas of its expert).
Exact balance would need every source's traffic, which no rank has without a collective.
Within an expert's rows the split is by position: row i of n goes to the replica whose share
of [0, 1) holds (i + 0.5) / n. Deterministic, no random draw, no host sync.

The result is a slot id per row and a count per slot: `phalanx.parallel.expert.dispatch` takes
the rows sorted by slot with those counts exactly as it takes rows sorted by expert today
(it only needs `counts.numel()` to be a multiple of ep), see docs/expert_slots.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from phalanx.errors import UserError


@dataclass(frozen=True)
class SlotPlacement:
    """Which expert each physical slot of one MoE layer holds, over one ep group (plain data)."""
    slot_expert: tuple[int, ...]
    """(S,) the expert held by each slot; rank i holds slots [i * S/ep, (i+1) * S/ep)."""
    n_experts: int
    ep: int
    rank_node: tuple[int, ...]
    """(ep,) the node (host) of each ep rank: ranks on one node exchange rows without the network."""
    def __post_init__(self) -> None:
        slots, experts, ep = len(self.slot_expert), self.n_experts, self.ep
        if ep < 1 or experts < 1:
            raise UserError(f"expert slots need ep >= 1 and n_experts >= 1 (ep={ep}, n_experts={experts})")
        if slots < experts:
            raise UserError(f"--expert-slots={slots} is fewer slots than the {experts} experts")
        if slots % ep:
            raise UserError(f"--expert-slots={slots} is not a multiple of ep={ep} ({slots} / {ep} is not a whole number of slots per rank)")
        if len(self.rank_node) != ep:
            raise UserError(f"rank_node names {len(self.rank_node)} ranks, but ep={ep}")
        held = np.asarray(self.slot_expert, dtype=np.int64)
        if held.min() < 0 or held.max() >= experts:
            raise UserError(f"a slot holds expert {int(held.max() if held.max() >= experts else held.min())}, outside 0..{experts - 1}")
        missing = np.flatnonzero(np.bincount(held, minlength=experts) == 0)
        if missing.size:
            raise UserError(f"no slot holds expert {int(missing[0])} ({slots} slots, {experts} experts)")
        per_rank = np.sort(held.reshape(ep, -1), axis=1)
        twice = np.flatnonzero((per_rank[:, 1:] == per_rank[:, :-1]).any(axis=1))
        if twice.size:
            # A second copy on one rank serves no token the first could not (the balancer's rule too).
            raise UserError(f"ep rank {int(twice[0])} holds two slots of one expert")

    @classmethod
    def one_per_expert(cls, n_experts: int, ep: int, node_size: int | None = None) -> SlotPlacement:
        """Today's layout: slot e holds expert e, so rank i holds experts [i * E/ep, (i+1) * E/ep)."""
        return cls(tuple(range(n_experts)), n_experts, ep, nodes_of_ranks(ep, node_size))

    @classmethod
    def from_slots(cls, slot_expert, n_experts: int, ep: int, node_size: int | None = None) -> SlotPlacement:
        """From one layer's row of a balancer `phy2log` (any int sequence)."""
        return cls(tuple(int(e) for e in slot_expert), n_experts, ep, nodes_of_ranks(ep, node_size))

    @property
    def slots(self) -> int:
        return len(self.slot_expert)

    @property
    def slots_per_rank(self) -> int:
        return self.slots // self.ep

    def rank_of_slot(self) -> np.ndarray:
        """(S,) the ep rank holding each slot."""
        return np.arange(self.slots) // self.slots_per_rank

    def local_slots(self, rank: int) -> range:
        """This rank's slots: the rows of its stacked [local_slots, ...] expert weights."""
        return range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def replicas(self) -> np.ndarray:
        """(E,) slots holding each expert."""
        return np.bincount(np.asarray(self.slot_expert), minlength=self.n_experts)

    def rank_loads(self, expert_load) -> np.ndarray:
        """(ep,) load each rank is predicted to carry: a replica carries load / replicas of its expert
        (the balancer's model, `phalanx.balance.measure.gpu_loads`)."""
        load = np.asarray(expert_load, dtype=float)
        held = np.asarray(self.slot_expert)
        return (load[held] / self.replicas()[held]).reshape(self.ep, -1).sum(axis=1)


def nodes_of_ranks(ep: int, node_size: int | None) -> tuple[int, ...]:
    """Node of each ep rank when the group's ranks fill nodes of `node_size` in order (None: one node).

    In training the ep ranks are adjacent data-parallel ranks; the trainer passes the node size
    of its launch (local world size / tp when tp ranks are innermost). Tests pass small sizes to
    exercise the cross-node path on one host.
    """
    if node_size is None:
        return (0,) * ep
    if node_size < 1 or (node_size < ep and ep % node_size):
        raise UserError(f"node size {node_size} must be at least 1 and divide ep={ep} (or be at least ep)")
    return tuple(rank // node_size for rank in range(ep))


def routing_weights(placement: SlotPlacement, expert_load=None) -> np.ndarray:
    """(S,) weight of each slot when a source spreads an expert's rows over several replicas.

    1 / predicted load of the slot's rank: lighter ranks get more. Every rank computes the same
    weights from the same (shared) load average. Without loads, or with none recorded yet, all 1.
    """
    if expert_load is None or not np.any(np.asarray(expert_load, dtype=float) > 0):
        return np.ones(placement.slots)
    loads = placement.rank_loads(expert_load)
    floor = 1e-9 * max(float(loads.max()), 1.0)  # a rank with no load: very large weight, not a division by 0
    return (1.0 / np.maximum(loads, floor))[placement.rank_of_slot()]


def routing_table(placement: SlotPlacement, rank: int, expert_load=None) -> tuple[np.ndarray, np.ndarray]:
    """Source rank `rank`'s choice among replicas: (candidates (E, K) slot ids, bounds (E, K)).

    For expert e, candidates[e, :m] are the slots it may use (increasing) and bounds[e, :m] the
    cumulative shares ending at exactly 1.0; padding repeats the last slot with bound 2.0
    (never reached, a row's position fraction is < 1).
    """
    if not 0 <= rank < placement.ep:
        raise UserError(f"source rank {rank} is outside the ep group of {placement.ep}")
    held = np.asarray(placement.slot_expert)
    slot_rank = placement.rank_of_slot()
    slot_node = np.asarray(placement.rank_node)[slot_rank]
    weights = routing_weights(placement, expert_load)
    width = int(placement.replicas().max())
    candidates = np.zeros((placement.n_experts, width), dtype=np.int64)
    bounds = np.full((placement.n_experts, width), 2.0)
    for expert in range(placement.n_experts):  # E is small (<= a few hundred); this runs once per placement
        replicas = np.flatnonzero(held == expert)
        own = replicas[slot_rank[replicas] == rank]
        near = replicas[slot_node[replicas] == placement.rank_node[rank]]
        chosen = own if own.size else near if near.size else replicas
        share = np.cumsum(weights[chosen]) / weights[chosen].sum()
        share[-1] = 1.0  # exactly: the last replica takes every remaining position
        candidates[expert, : chosen.size], candidates[expert, chosen.size :] = chosen, chosen[-1]
        bounds[expert, : chosen.size] = share
    return candidates, bounds


class SlotRouter:
    """One source rank's routing for one MoE layer, as tensors on the device.

    Built when the placement changes (at each rebalance, from the load average of that moment),
    so the proportions are fixed between rebalances; building loops over the experts in Python
    (`routing_table`): affordable once per rebalance, not per micro-batch.
    """
    def __init__(self, placement: SlotPlacement, rank: int, expert_load=None, device=None):
        self.placement = placement
        candidates, bounds = routing_table(placement, rank, expert_load)
        self.candidates = torch.as_tensor(candidates, device=device)  # (E, K)
        self.bounds = torch.as_tensor(bounds, dtype=torch.float64, device=device)  # (E, K)

    def route(self, counts: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows sorted by expert with `counts` (E,) per expert -> (slot per row (n,),
        order (n,): the rows sorted by slot (stable), count per slot (S,)).

        `rows[order]` with the slot counts is what `dispatch` takes; the combined output in that
        order goes back with `out.index_copy(0, order, combined)`. `n_rows` (= counts.sum()) is
        passed so no host sync is needed to size the tensors.
        """
        device = counts.device
        experts = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=n_rows)  # (n,)
        starts = torch.cumsum(counts, 0) - counts  # (E,) first row of each expert
        position = torch.arange(n_rows, device=device) - starts[experts]  # (n,) index within the expert's rows
        fraction = (position.double() + 0.5) / counts[experts].double()  # (n,) in (0, 1)
        pick = (self.bounds[experts] <= fraction[:, None]).sum(dim=1)  # (n,) which candidate
        slots = self.candidates[experts, pick]  # (n,)
        order = torch.argsort(slots, stable=True)
        # index_add, not bincount: CUDA's bincount reads the largest value back to the host.
        slot_counts = torch.zeros(self.placement.slots, dtype=counts.dtype, device=device).index_add_(
            0, slots, torch.ones_like(slots, dtype=counts.dtype))  # (S,)
        return slots, order, slot_counts


def local_stack(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's [local_slots, ...] stack of a slot tensor (weight, gradient, AdamW moment).

    Under DDP that is the tensor itself. Under FSDP it is a DTensor sharded over edp inside
    each slot (`phalanx.parallel.expert._within_slots`), and its local tensor holds this edp
    rank's slice of every local slot, the same slice on every rank of the ep group, so slot
    code works on it unchanged. A view of the same storage: writes reach the parameter (and
    FSDP's sharded buffer, which the next all-gather reads).
    """
    if not isinstance(tensor, DTensor):
        return tensor
    if any(p.is_shard(0) for p in tensor.placements):
        raise UserError("an expert slot stack is sharded on its slot dim 0; slots need it sharded within slots")
    return tensor.to_local()
