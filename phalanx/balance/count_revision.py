"""Revisiting replica counts: other counts near the chosen ones, each packed afresh, the best kept.

The greedy counts (packing.replicate: each extra replica to the highest load per replica) ignore
how replicas pack. With one very hot expert and a second hot one on a node, they can give the
two more replicas together than the node has GPUs (6 + 4 on 8 GPUs), so two GPUs carry a share
of both, while one replica fewer of each (5 + 3, the two freed slots to lukewarm experts) packs
every GPU to about the node's mean. No single swap or replica move (replica_moves.py) reaches
that: taking one replica off either hot expert first raises its other GPUs' loads. Here, in each
row more than AT_BOUND above its lower bound, the count vectors one or two transfers away are
built (a transfer: one replica fewer for a donor, one of the 3 highest loads per replica among
ids with two or more, one more for a receiver, one of the 4 highest that may take another), all
candidates of all rows in one batch. Where they are many, a screen (where the 2 x gpus largest
replicas land) keeps one per row; the rest are packed from scratch (packing.pack_replicas) and
refined by swaps; a row takes its best where that lowers its top load, and, with `rounds` > 1,
the search repeats from there.
"""

from __future__ import annotations

import itertools

import numpy as np

from phalanx.balance.packing import pack_replicas, replicas_of
from phalanx.balance.refine import refine
from phalanx.balance.replica_moves import GOOD_ENOUGH, lower_bound, top_load

_RELATIVE_GAIN = 1e-12  # as in refine.py: a change must beat rounding noise
AT_BOUND = 1e-2
"""A row whose top load is within this (relative) of its lower bound is left as it is."""
FULL_EVALUATION_SLOTS = 4_000
"""Above this many candidate slots per round, candidates are screened by an estimate first."""
SCREENED_KEEP = 1
"""Candidates per row that pass the screen and are packed in full."""
MOST_CANDIDATES = 8_000
"""Candidates per round at most (rows x transfers); fewer donors and receivers above it."""


def _transfers(donors: int, receivers: int) -> np.ndarray:
    """(moves, 4): donor rank, donor rank, receiver rank, receiver rank of every one- and
    two-transfer move (-1: unused)."""
    table = [(x, -1, y, -1) for x, y in itertools.product(range(donors), range(receivers))]
    for xs in itertools.combinations_with_replacement(range(donors), 2):
        for ys in itertools.combinations_with_replacement(range(receivers), 2):
            table.append(xs + ys)
    return np.array(table)


def _moves(expert_load: np.ndarray, count: np.ndarray, top: np.ndarray, cap: int, donors: int,
           receivers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The transfer moves worth packing: (row (m,), ids touched (m, 4), replicas added (m, 4)).

    Valid moves only (every touched id keeps 1..cap replicas), each distinct count vector once
    per row, and only those whose new largest share is below the row's top load (else the
    top cannot fall). Works on the 4 touched ids, never on whole count vectors.
    """
    rows, ids = count.shape
    share = expert_load / np.maximum(count, 1)
    donor = np.argsort(np.where(count >= 2, -share, np.inf), axis=1, kind="stable")[:, :donors]  # (rows, donors)
    receiver = np.argsort(np.where((count >= 1) & (count < cap), -share, np.inf), axis=1, kind="stable")[:, :receivers]
    table = _transfers(donor.shape[1], receiver.shape[1])  # (k, 4)
    used = table >= 0
    delta = np.where(used, [-1, -1, 1, 1], 0)  # (k, 4)
    touched = np.concatenate([donor[:, np.maximum(table[:, :2], 0)], receiver[:, np.maximum(table[:, 2:], 0)]], axis=2)  # (rows, k, 4)
    same = touched[:, :, :, None] == touched[:, :, None, :]  # (rows, k, 4, 4)
    net = (same * delta[None, :, None, :]).sum(axis=3)  # (rows, k, 4): change of each touched id's count
    every = np.arange(rows)[:, None, None]
    before = count[every, touched]
    after = before + net
    changed = used & (net != 0)
    valid = np.where(used, (before >= 1) & (after >= 1) & (after <= cap), True).all(axis=2) & changed.any(axis=2)
    new_share = np.where(changed, expert_load[every, touched] / np.maximum(after, 1), 0.0).max(axis=2)
    valid &= new_share < top[:, None] * (1 - _RELATIVE_GAIN)
    row, move = np.nonzero(valid)
    if not row.size:
        return row, touched[row, move], delta[move]
    # Different moves can give one count vector (a donor that is also a receiver): keep the first.
    # The fingerprint is linear in the count change, so equal changes give equal fingerprints.
    fingerprint = (delta[move] * np.random.default_rng(0).random(ids)[touched[row, move]]).sum(axis=1)
    order = np.lexsort((fingerprint, row))
    repeat = (row[order][1:] == row[order][:-1]) & (fingerprint[order][1:] == fingerprint[order][:-1])
    once = np.sort(order[np.r_[True, ~repeat]])
    return row[once], touched[row[once], move[once]], delta[move[once]]


def revise_counts(slots: np.ndarray, expert_load: np.ndarray, count: np.ndarray, cap: int,
                  donors: int = 3, receivers: int = 4, rounds: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(slots, count) with, per row, the best repacked count vector found; never worse than the input.

    `slots` (rows, gpus, slots per GPU), `expert_load` (rows, ids) and `count` (rows, ids) as in
    replica_moves.improve; ids with count 0 name no expert and stay without replicas.
    """
    rows, gpus, c = slots.shape
    slots, count = slots.copy(), count.copy()
    top = top_load(slots, expert_load / np.maximum(count, 1))
    bound = lower_bound(expert_load, cap, gpus)
    active = np.flatnonzero(top > bound * (1 + AT_BOUND))
    while donors * receivers > 1 and len(active) * len(_transfers(donors, receivers)) > MOST_CANDIDATES:
        donors, receivers = max(1, donors - 1), max(1, receivers - 1)
    for _ in range(rounds):
        if not active.size:
            break
        row, touched, delta = _moves(expert_load[active], count[active], top[active], cap, donors, receivers)
        if not row.size:
            break
        trial_count = count[active[row]]  # (trials, ids), a copy
        for column in range(4):  # one id per trial and column: plain fancy indexing adds right
            trial_count[np.arange(len(row)), touched[:, column]] += delta[:, column]
        if len(row) * gpus * c > FULL_EVALUATION_SLOTS:
            keep = _screen(row, expert_load[active[row]], trial_count, gpus)
            row, trial_count = row[keep], trial_count[keep]
        trial_load = expert_load[active[row]]
        unit = trial_load / np.maximum(trial_count, 1)
        trial = refine(pack_replicas(unit, replicas_of(trial_count), gpus), unit,
                       good_enough=bound[active[row]] * (1 + GOOD_ENOUGH))[0]
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

    The estimate places only the 2 x gpus largest replicas (the ones that collide on a GPU),
    as `pack` would, two per GPU: the largest `gpus` one per GPU, then the next ones, heaviest
    first, each onto the least loaded GPU with one replica and without that id. The small
    replicas left fill in. (Not clipped at the row's mean load, which all of a row's trials
    share: clipped, they would tie.)
    """
    trials = len(row)
    share = expert_load / np.maximum(count, 1)  # (trials, ids)
    # The 2 x gpus largest replicas come from the 2 x gpus ids with the largest shares.
    k = min(2 * gpus, share.shape[1])
    top_ids = np.argpartition(-share, k - 1, axis=1)[:, :k] if k < share.shape[1] else np.broadcast_to(np.arange(k), (trials, k))
    top_ids = np.take_along_axis(top_ids, np.argsort(-np.take_along_axis(share, top_ids, axis=1), axis=1, kind="stable"), axis=1)
    # Replica p (0 .. 2 gpus - 1, heaviest first) belongs to the first id whose cumulative count exceeds p.
    reach = np.cumsum(np.take_along_axis(count, top_ids, axis=1), axis=1)  # (trials, k)
    owner = (reach[:, None, :] <= np.arange(2 * gpus)[None, :, None]).sum(axis=2)  # (trials, 2 gpus)
    big = np.where(owner < k, np.take_along_axis(top_ids, np.minimum(owner, k - 1), axis=1), -1)
    big_share = np.where(big >= 0, np.take_along_axis(share, np.maximum(big, 0), axis=1), 0.0)
    load = big_share[:, :gpus].copy()  # (trials, gpus): the first round, one per GPU
    taken = np.zeros((trials, gpus), dtype=bool)
    every = np.arange(trials)
    for j in range(gpus, 2 * gpus):  # the second round, heaviest first into the lightest GPU allowed
        blocked = taken | (big[:, :gpus] == big[:, j:j + 1])
        choice = np.where(blocked, np.inf, load).argmin(axis=1)
        load[every, choice] += big_share[:, j]
        taken[every, choice] = True
    estimate = load.max(axis=1)
    order = np.lexsort((np.arange(trials), estimate, row))
    rank = np.arange(trials) - np.searchsorted(row[order], row[order])  # place of each trial within its row
    return np.sort(order[rank < SCREENED_KEEP])
