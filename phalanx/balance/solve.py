"""`rebalance`: the whole placement for all layers, torch-free, and its report.

Order: check the input; greedy construction (placement.py); refinement (swaps and replica
moves, replica_moves.py; replica counts revisited, count_revision.py; kicks on small layouts);
with a previous placement, the cheaper-to-move choice per layer (incremental.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from phalanx.balance import incremental, measure, speed_weighted
from phalanx.balance.node_assignments import lightest_assignments
from phalanx.balance.packing import pack, spread
from phalanx.balance.placement import NodeFrame, Problem, check_problem, greedy, group_bounds
from phalanx.balance.count_revision import AT_BOUND, revise_counts
from phalanx.balance.replica_moves import improve, improve_with_kicks
from phalanx.errors import UserError


@dataclass
class Result:
    """A placement and how it was made."""

    phy2log: np.ndarray  # (layers, slots): the expert each slot holds
    problem: Problem
    seconds: float  # the algorithm alone, input checks included
    previous: np.ndarray | None = None  # the placement it was planned from, if any

    @property
    def logcnt(self) -> np.ndarray:
        """Replicas per expert, (layers, experts)."""
        return measure.replica_counts(self.phy2log, self.problem.experts)

    def log2phy(self) -> np.ndarray:
        """(layers, experts, most replicas): each expert's slots in increasing order, padded with -1."""
        layers, slots = self.phy2log.shape
        count = self.logcnt
        order = np.argsort(self.phy2log, axis=1, kind="stable")  # slots grouped by expert, each group ascending
        first = np.cumsum(count, axis=1) - count  # (layers, experts): where each expert's group starts
        width = int(count.max())
        pick = first[:, :, None] + np.arange(width)  # (layers, experts, width)
        valid = np.arange(width) < count[:, :, None]
        taken = np.take_along_axis(order, np.minimum(pick, slots - 1).reshape(layers, -1), axis=1).reshape(pick.shape)
        return np.where(valid, taken, -1)

    def report(self, load: np.ndarray) -> dict:
        """The `--json` record (docs/balance.md)."""
        gpus = self.problem.gpus
        after = measure.gpu_loads(load, self.phy2log, gpus)
        before = measure.unreplicated_loads(load, gpus)
        balanced, uneven = measure.balancedness(after), measure.imbalance(after)
        record = {
            "phy2log": self.phy2log.tolist(),
            "log2phy": self.log2phy().tolist(),
            "logcnt": self.logcnt.tolist(),
            "balancedness": {"per_layer": balanced.tolist(), "overall": float(balanced.mean())},
            "imbalance": {"per_layer": uneven.tolist(), "overall": float(uneven.mean())},
            "before": {"balancedness": float(measure.balancedness(before).mean()), "imbalance": float(measure.imbalance(before).mean())},
            "policy": self.problem.policy,
            "seconds": self.seconds,
        }
        if self.previous is not None:
            record["moved_slots"] = measure.moved_slots(self.phy2log, self.previous)
        return record


LARGEST_LOAD = 2.0**64
"""Loads above this (no token count comes near it) are scaled down before placing."""


def check_load(load) -> np.ndarray:
    """Loads as a float (layers, experts) array: finite and non-negative."""
    try:
        array = np.asarray(load, dtype=float)
    except (TypeError, ValueError):
        raise UserError("the load must be a rectangular [layers][experts] table of numbers") from None
    if array.ndim != 2:
        raise UserError(f"the load must be a [layers][experts] table, got {array.ndim} dimension(s) of shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise UserError("the load holds non-finite values (nan or inf)")
    if np.any(array < 0):
        layer, expert = map(int, np.argwhere(array < 0)[0])
        raise UserError(f"the load holds negative values (layer {layer}, expert {expert}: {array[layer, expert]:g})")
    if array.size and array.max() > LARGEST_LOAD:
        # A placement depends only on the loads' ratios: scale by a power of two (exact), so
        # sums per GPU and refinement's float32 arithmetic cannot overflow into inf and nan.
        array = np.ldexp(array, -int(np.ceil(np.log2(array.max()))))
    return array


def rebalance(load, replicas: int, groups: int, nodes: int, gpus: int, *, policy: str = "auto",
              refine: bool = True, previous=None, speeds=None) -> Result:
    """Place `replicas` slots per layer over `gpus` GPUs on `nodes` nodes (see placement.py).
    `speeds`: each GPU's relative speed, to even load / speed instead of load (one node,
    speed_weighted.py); None: all alike."""
    start = time.perf_counter()
    load = check_load(load)
    problem = check_problem(*load.shape, replicas, groups, nodes, gpus, policy)
    if previous is not None:
        previous = incremental.check_previous(previous, problem)
    if speeds is not None:
        if nodes != 1:
            raise UserError(f"rank speeds place slots on one node only, not {nodes}")
        return Result(speed_weighted.place(load, replicas, speeds, previous), problem, time.perf_counter() - start, previous)
    frame = greedy(load, problem)
    if refine:
        _improve(frame, load, problem)
    phy2log = frame.phy2log()
    if refine and problem.frame_nodes > 1:
        phy2log = _better_node_assignments(load, problem, phy2log)
    if previous is not None:
        phy2log = _closer_to(previous, phy2log, load, problem, refine)
    return Result(phy2log, problem, time.perf_counter() - start, previous)


KICK_BUDGET, MOST_KICKS = 4_000, 32
"""Kicks of iterated local search per call: KICK_BUDGET / slots, at most MOST_KICKS. Small
layouts, where a greedy placement is coarse, get the most; 8 x 64 into 80 slots gets 6; 58 x
256 into 288 slots (16,704 slots) gets none: its time stays within the balancer's budget."""


def _improve(frame: NodeFrame, load: np.ndarray, problem: Problem) -> None:
    """Swaps and replica moves (replica_moves.py), then other replica counts (count_revision.py),
    then kicks where the layout is small, on the frame, in place."""
    cap = problem.gpus // problem.frame_nodes
    kicks = min(MOST_KICKS, KICK_BUDGET // frame.slots.size)
    weight = frame.node_load(load)
    slots, count = improve(frame.slots, weight, frame.count, cap, settled=AT_BOUND)
    # Small layouts (those that get kicks) also get a second round of count revision; on large
    # ones its fixed cost (a pack of every slot of a node, one step per slot) buys little.
    slots, count = revise_counts(slots, weight, count, cap, rounds=2 if kicks else 1)
    if kicks:
        slots, count = improve_with_kicks(slots, weight, count, cap, kicks)
    frame.slots, frame.count = slots, count


def _better_node_assignments(load: np.ndarray, problem: Problem, phy2log: np.ndarray) -> np.ndarray:
    """Per layer, a placement from another group-to-node assignment, where it is more balanced.

    Candidates: the greedy assignment with nodes holding unequal numbers of groups (with one hot
    group, equal numbers leave its node above the others by more than any packing within the
    node can mend), and the few lightest assignments by enumeration (node_assignments.py). A
    candidate is built only in the layers where it could win: its most loaded node over that
    node's GPUs (a floor on its top GPU load) is below the current top GPU load.
    """
    layers, experts = load.shape
    n, node_gpus = problem.nodes, problem.gpus // problem.nodes
    group_load = load.reshape(layers, problem.groups, -1).sum(axis=2)  # (layers, groups)
    low, high = group_bounds(problem)
    candidates = [spread(group_load, n, low, high)[0]]
    enumerated = lightest_assignments(group_load, n, low, high, keep=3)
    if enumerated is not None:
        candidates += list(enumerated.transpose(1, 0, 2))
    even = _canonical(pack(group_load, n)[0])  # the assignment the placement was built from
    phy2log = phy2log.copy()
    for node_of_group in candidates:
        top = measure.gpu_loads(load, phy2log, problem.gpus).max(axis=1)
        node_load = (group_load[:, :, None] * (node_of_group[:, :, None] == np.arange(n))).sum(axis=1)  # (layers, nodes)
        new = (_canonical(node_of_group) != even).any(axis=1)
        redo = np.flatnonzero(new & (node_load.max(axis=1) / node_gpus < top * (1 - 1e-12)))
        if not redo.size:
            continue
        frame = greedy(load[redo], problem, node_of_group=node_of_group[redo])
        _improve(frame, load[redo], problem)
        candidate = frame.phy2log()
        better = measure.gpu_loads(load[redo], candidate, problem.gpus).max(axis=1) < top[redo]
        phy2log[redo[better]] = candidate[better]
    return phy2log


def _canonical(node_of_group: np.ndarray) -> np.ndarray:
    """(layers, groups) with nodes renamed in order of first use: equal where the split is the same."""
    layers, groups = node_of_group.shape
    first = np.full((layers, int(node_of_group.max()) + 1), groups)
    np.minimum.at(first, (np.arange(layers)[:, None], node_of_group), np.arange(groups))
    rank = np.argsort(np.argsort(first, axis=1, kind="stable"), axis=1)  # (layers, nodes): new name of each node
    return np.take_along_axis(rank, node_of_group, axis=1)


def _closer_to(previous: np.ndarray, fresh: np.ndarray, load: np.ndarray, problem: Problem, refined: bool) -> np.ndarray:
    """Per layer, the previous placement (refined) if nearly as balanced as `fresh`, else `fresh` aligned to it."""
    kept, usable = incremental.keep(load, problem, previous, fresh if refined else None)
    aligned = incremental.align(fresh, previous, problem)
    score = lambda p: measure.balancedness(measure.gpu_loads(load, p, problem.gpus))  # noqa: E731
    take_kept = usable & (score(kept) >= score(fresh) - incremental.KEEP_WITHIN)
    return np.where(take_kept[:, None], kept, aligned)
