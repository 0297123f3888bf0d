"""Re-planning from a previous placement, so that few expert weights have to move.

Every slot whose expert changes is a copy of that expert's weights onto a GPU. A plan made
from scratch ignores where experts already are, and changes most slots even when the loads
barely drifted. Two cheaper candidates, per layer:

* `keep`: the previous placement, its replica counts unchanged, refined with the new loads
  (each swap moves two slots);
* `align`: the fresh plan relabelled to look like the previous one. Nodes are interchangeable,
  GPUs within a node are, and slots within a GPU are, so permuting them changes no load: match
  nodes, then GPUs, by the experts they share (greedily, largest overlap first), then keep each
  shared expert in its old slot.

`solve.rebalance` takes `keep` where its balancedness is within `KEEP_WITHIN` of the fresh
plan's, else `align`.
"""

from __future__ import annotations

import numpy as np

from phalanx.balance.measure import balancedness, gpu_loads, replica_counts
from phalanx.balance.placement import Problem
from phalanx.balance.refine import refine
from phalanx.errors import UserError

# How much balancedness (mean/max) a layer may give up to keep its previous placement.
KEEP_WITHIN = 0.01


def check_previous(previous, problem: Problem) -> np.ndarray:
    """The previous `phy2log` as an int array, after checking it fits this problem."""
    try:
        phy2log = np.asarray(previous, dtype=float)
    except (TypeError, ValueError):
        raise UserError("the previous placement's phy2log is not a rectangular list of numbers") from None
    want = (problem.layers, problem.replicas)
    if phy2log.shape != want:
        raise UserError(f"the previous placement's phy2log is {' x '.join(map(str, phy2log.shape))}, but this plan is {want[0]} layers x {want[1]} slots")
    if not np.all(np.isfinite(phy2log)) or np.any(phy2log != np.round(phy2log)) or phy2log.min() < 0 or phy2log.max() >= problem.experts:
        raise UserError(f"the previous placement's phy2log must hold expert ids 0..{problem.experts - 1}")
    phy2log = phy2log.astype(np.int64)
    missing = replica_counts(phy2log, problem.experts) == 0
    if missing.any():
        layer, expert = map(int, np.argwhere(missing)[0])
        raise UserError(f"the previous placement has no replica of expert {expert} in layer {layer}")
    return phy2log


def keep(load: np.ndarray, problem: Problem, previous: np.ndarray, fresh: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(previous placement refined with the new loads, which layers may use it (L,)).

    With `fresh` (the refined plan from scratch), refinement stops once a layer's top GPU is
    as low as `KEEP_WITHIN / 2` below the fresh plan's balancedness asks: every swap beyond
    that moves weights for a gain the user did not need. Without it, no refinement.
    A layer may not be kept where the previous placement breaks this policy's rules: two
    replicas of one expert on a GPU, or (hierarchical) a group whose replicas span nodes.
    """
    layers, experts = load.shape
    n, gpus, c = problem.frame_nodes, problem.gpus, problem.slots_per_gpu
    per_gpu = np.sort(previous.reshape(layers, gpus, c), axis=2)
    usable = ~(per_gpu[:, :, 1:] == per_gpu[:, :, :-1]).any(axis=(1, 2))
    if n > 1:
        node_of_slot = np.broadcast_to(np.arange(problem.replicas) // (problem.replicas // n), previous.shape)
        low = np.full((layers, experts), n)
        high = np.full((layers, experts), -1)
        np.minimum.at(low, (np.arange(layers)[:, None], previous), node_of_slot)
        np.maximum.at(high, (np.arange(layers)[:, None], previous), node_of_slot)
        per_group = lambda x: x.reshape(layers, problem.groups, -1)  # noqa: E731
        usable &= (per_group(low).min(axis=2) == per_group(high).max(axis=2)).all(axis=1)
    if fresh is None:
        return previous.copy(), usable
    fresh_loads = gpu_loads(load, fresh, gpus)
    wanted = balancedness(fresh_loads) - KEEP_WITHIN / 2
    good_enough = fresh_loads.mean(axis=1) / np.maximum(wanted, 1e-12)  # (layers,): top load that reaches it
    unit = load / replica_counts(previous, experts)  # (layers, experts); every expert has >= 1 replica
    rows = usable.repeat(n)  # (layers * n,): ids are global experts in these rows
    slots = previous.reshape(layers * n, gpus // n, c).copy()
    slots[rows] = refine(slots[rows], np.repeat(unit, n, axis=0)[rows], good_enough=good_enough.repeat(n)[rows])[0]
    return slots.reshape(layers, -1), usable


def align(fresh: np.ndarray, previous: np.ndarray, problem: Problem) -> np.ndarray:
    """`fresh` with nodes, GPUs and slots permuted to share as many slots with `previous` as it can."""
    layers, experts = len(fresh), problem.experts
    n, gpus, c = problem.frame_nodes, problem.gpus, problem.slots_per_gpu
    per_node = gpus // n
    if n > 1:
        node_match = _match(_overlap(fresh.reshape(layers, n, -1), previous.reshape(layers, n, -1), experts))
        fresh = _permute(fresh.reshape(layers, n, -1), node_match).reshape(layers, -1)
    gpu_overlap = _overlap(fresh.reshape(layers, gpus, c), previous.reshape(layers, gpus, c), experts).astype(float)
    same_node = (np.arange(gpus)[:, None] // per_node) == (np.arange(gpus)[None, :] // per_node)
    gpu_overlap[:, ~same_node] = -np.inf  # a GPU may only take the place of one on its own node
    fresh = _permute(fresh.reshape(layers, gpus, c), _match(gpu_overlap))  # (layers, gpus, c)
    old = previous.reshape(layers, gpus, c)
    shared = fresh[:, :, :, None] == old[:, :, None, :]  # (layers, gpus, new position, old position)
    # A previous plan may hold an expert twice on a GPU (the reference does): keep the first.
    repeated = ((old[:, :, :, None] == old[:, :, None, :]) & np.tri(c, k=-1, dtype=bool)).any(axis=3)
    shared &= ~repeated[:, :, None, :]
    kept_position, kept_item = shared.any(axis=2), shared.any(axis=3)
    # The new experts not on this GPU before fill the positions not kept, in order.
    free_positions = np.argsort(kept_position, axis=2, kind="stable")
    new_items = np.take_along_axis(fresh, np.argsort(kept_item, axis=2, kind="stable"), axis=2)
    out = np.empty_like(fresh)
    np.put_along_axis(out, free_positions, new_items, axis=2)
    return np.where(kept_position, old, out).reshape(layers, -1)


def _overlap(new: np.ndarray, old: np.ndarray, experts: int) -> np.ndarray:
    """Experts shared by each (new part, old part) pair: (layers, parts, parts) from (layers, parts, slots)."""
    layers, parts, _ = new.shape

    def members(x):  # (layers, parts, experts): does the part hold the expert
        out = np.zeros((layers, parts, experts), dtype=np.float32)
        out[np.arange(layers)[:, None, None], np.arange(parts)[None, :, None], x] = 1
        return out

    return members(new) @ members(old).transpose(0, 2, 1)


def _match(score: np.ndarray) -> np.ndarray:
    """Greedy matching, largest score first (lowest indices on a tie): (layers, k) new part -> old position."""
    layers, k, _ = score.shape
    score = np.array(score, dtype=float)
    target = np.empty((layers, k), dtype=np.int64)
    every_layer = np.arange(layers)
    for _ in range(k):
        new, old = np.divmod(score.reshape(layers, -1).argmax(axis=1), k)
        target[every_layer, new] = old
        score[every_layer, new, :] = -np.inf
        score[every_layer, :, old] = -np.inf
    return target


def _permute(parts: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Move part p of each layer to position target[layer, p]: (layers, parts, ...)."""
    out = np.empty_like(parts)
    out[np.arange(len(parts))[:, None], target] = parts
    return out
