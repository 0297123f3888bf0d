"""Revisiting replica counts: other counts near the chosen ones, each packed afresh, the best kept.

The greedy counts (packing.replicate: each extra replica to the highest load per replica) ignore
how replicas pack. With one very hot expert and a second hot one on a node, they can give the
two more replicas together than the node has GPUs (6 + 4 on 8 GPUs), so two GPUs carry a share
of both, while one replica fewer of each (5 + 3, the two freed slots to lukewarm experts) packs
every GPU to about the node's mean. No single swap or replica move (replica_moves.py) reaches
that: taking one replica off either hot expert first raises its other GPUs' loads. Here, in each
row that is not yet at its lower bound, count vectors one or two transfers away are built (a
transfer: one replica fewer for a donor, one of the most replicated heavy ids, one more for a
receiver, one of the highest loads per replica that may take another), each packed from scratch
(packing.pack_replicas) and refined by swaps, all candidates of all rows in one batch; a row
takes its best candidate where that lowers its top load, and the search repeats from there.
"""

from __future__ import annotations

import itertools

import numpy as np

from phalanx.balance.packing import pack_replicas, replicas_of
from phalanx.balance.refine import refine
from phalanx.balance.replica_moves import lower_bound, top_load

_RELATIVE_GAIN = 1e-12  # as in refine.py: a change must beat rounding noise
AT_BOUND = 5e-3
"""A row whose top load is within this (relative) of its lower bound is left as it is."""
FULL_EVALUATION_SLOTS = 20_000
"""Above this many candidate slots per round, candidates are screened by an estimate first."""
SCREENED_KEEP = 2
"""Candidates per row that pass the screen and are packed in full."""
MOST_CANDIDATE_SLOTS = 200_000
"""Candidates x slots packed per round at most; fewer donors and receivers above it."""


def _transfers(donors: int, receivers: int) -> tuple[np.ndarray, np.ndarray]:
    """(candidates, 2) donor ranks and receiver ranks of every one- and two-transfer move; -1: none."""
    give, take = [], []
    for x, y in itertools.product(range(donors), range(receivers)):
        give.append((x, -1))
        take.append((y, -1))
    for xs in itertools.combinations_with_replacement(range(donors), 2):
        for ys in itertools.combinations_with_replacement(range(receivers), 2):
            give.append(xs)
            take.append(ys)
    return np.array(give), np.array(take)


def _candidates(expert_load: np.ndarray, count: np.ndarray, cap: int, donors: int, receivers: int) -> np.ndarray:
    """(rows, candidates, ids) count vectors, each a valid count (1..cap, same total) or a copy of `count`."""
    rows, ids = count.shape
    share = expert_load / np.maximum(count, 1)
    donor = np.argsort(np.where(count >= 2, -share, np.inf), axis=1, kind="stable")[:, :donors]  # (rows, donors)
    receiver = np.argsort(np.where((count >= 1) & (count < cap), -share, np.inf), axis=1, kind="stable")[:, :receivers]
    give, take = _transfers(donor.shape[1], receiver.shape[1])
    k = len(give)
    new = np.repeat(count[:, None, :], k, axis=1)  # (rows, k, ids)
    every = np.arange(rows)[:, None]
    for column in range(2):  # each (row, candidate) once per column: plain fancy indexing adds right
        used = np.flatnonzero(give[:, column] >= 0)
        new[every, used[None, :], donor[:, give[used, column]]] -= 1
        used = np.flatnonzero(take[:, column] >= 0)
        new[every, used[None, :], receiver[:, take[used, column]]] += 1
    present = count[:, None, :] >= 1
    valid = np.where(present, (new >= 1) & (new <= cap), new == 0).all(axis=2) & (new != count[:, None, :]).any(axis=2)
    return np.where(valid[:, :, None], new, count[:, None, :]), valid


def revise_counts(slots: np.ndarray, expert_load: np.ndarray, count: np.ndarray, cap: int,
                  donors: int = 3, receivers: int = 4, rounds: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(slots, count) with, per row, the best repacked count vector found; never worse than the input.

    `slots` (rows, gpus, slots per GPU), `expert_load` (rows, ids) and `count` (rows, ids) as in
    replica_moves.improve; ids with count 0 name no expert and stay without replicas.
    """
    rows, gpus, c = slots.shape
    slots, count = slots.copy(), count.copy()
    top = top_load(slots, expert_load / np.maximum(count, 1))
    bound = lower_bound(expert_load, cap, gpus)
    active = np.flatnonzero(top > bound * (1 + AT_BOUND))
    while donors * receivers > 1 and len(active) * len(_transfers(donors, receivers)[0]) * gpus * c > MOST_CANDIDATE_SLOTS:
        donors, receivers = max(1, donors - 1), max(1, receivers - 1)
    for _ in range(rounds):
        if not active.size:
            break
        new, valid = _candidates(expert_load[active], count[active], cap, donors, receivers)
        # Only candidates whose largest share is below the top load can lower it.
        biggest = (expert_load[active][:, None, :] / np.maximum(new, 1)).max(axis=2)
        valid &= biggest < top[active][:, None] * (1 - _RELATIVE_GAIN)
        row, cand = np.nonzero(valid)
        if not row.size:
            break
        if len(row) * gpus * c > FULL_EVALUATION_SLOTS:
            keep = _screen(row, expert_load[active[row]], new[row, cand], gpus)
            row, cand = row[keep], cand[keep]
        trial_count = new[row, cand]  # (trials, ids)
        trial_load = expert_load[active[row]]
        unit = trial_load / np.maximum(trial_count, 1)
        trial = refine(pack_replicas(unit, replicas_of(trial_count), gpus), unit)[0]
        trial_top = top_load(trial, unit)
        # Per active row, its best trial (the first on a tie).
        order = np.lexsort((np.arange(len(row)), trial_top, row))
        first = order[np.r_[True, row[order][1:] != row[order][:-1]]]
        won = first[trial_top[first] < top[active[row[first]]] * (1 - _RELATIVE_GAIN)]
        target = active[row[won]]
        slots[target], count[target], top[target] = trial[won], trial_count[won], trial_top[won]
        active = target[top[target] > bound[target] * (1 + AT_BOUND)]
    return slots, count


def _screen(row: np.ndarray, expert_load: np.ndarray, count: np.ndarray, gpus: int) -> np.ndarray:
    """Indices of the SCREENED_KEEP trials per row with the lowest estimated top load.

    The estimate packs only the 2 x gpus largest replicas, two per GPU (the ones that collide
    on a GPU), and takes the larger of that and the mean load: the small replicas left fill in.
    """
    unit = expert_load / np.maximum(count, 1)
    replica = replicas_of(count)  # (trials, slots)
    share = np.take_along_axis(unit, replica, axis=1)
    big = np.argsort(-share, axis=1, kind="stable")[:, :2 * gpus]  # (trials, 2 gpus)
    big_id = np.take_along_axis(replica, big, axis=1)
    packed = pack_replicas(unit, big_id, gpus)  # (trials, gpus, 2)
    estimate = np.maximum(top_load(packed, unit), expert_load.sum(axis=1) / gpus)
    order = np.lexsort((np.arange(len(row)), estimate, row))
    rank = np.arange(len(row)) - np.searchsorted(row[order], row[order])  # place of each trial within its row
    return np.sort(order[rank < SCREENED_KEEP])
