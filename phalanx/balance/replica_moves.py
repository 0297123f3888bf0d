"""Replica moves: give a slot of the most loaded GPU to another expert, changing replica counts.

Swaps (refine.py) keep every expert's replica count, and the greedy counts (replicate: one more
replica to the expert with the highest load per replica) are not always the ones that pack
best: on small layouts, where each GPU holds few slots, the best placement often gives a hot
expert one replica fewer and a lukewarm one more. A move takes a replica of expert x (x keeps
at least one) off the most loaded GPU `a` and puts a replica of expert y (not on `a`, below
the cap of one per GPU of the node) in its place: `a` loses x's share and gains y's new one,
every other GPU holding x carries more of it (x / (count - 1)) and every one holding y less.

`improve` alternates swaps and moves, in all rows at once, while either lowers a row's top
GPU load; every step lowers it strictly, so it ends, and the result is never below the
placement it starts from.
"""

from __future__ import annotations

import numpy as np

from phalanx.balance.refine import refine

_RELATIVE_GAIN = 1e-12  # as in refine.py: a move must beat rounding noise
MOVE_CANDIDATES = 16  # new-replica candidates per move search (all ids where a row has fewer)
WIDE_MOVE_CANDIDATES = 4  # the same where the freed slot may be on any GPU (gpus x more slots)
GOOD_ENOUGH = 2e-4
"""A row whose top load is within this (relative) of its lower bound is not improved further."""


def improve(slots: np.ndarray, expert_load: np.ndarray, count: np.ndarray, cap: int,
            max_rounds: int = 16, settled: float = GOOD_ENOUGH) -> tuple[np.ndarray, np.ndarray]:
    """(slots, count) after swaps and replica moves; the inputs are not changed.

    `slots` (rows, gpus, slots per GPU) holds row-local ids; `expert_load` (rows, ids) is each
    id's load (0 for ids naming no expert, which have count 0 and are never given a replica);
    `count` (rows, ids) its replicas; `cap` the most replicas an id may have (GPUs per row).
    Rows within `settled` (relative) of their lower bound get no replica moves.
    """
    count = count.copy()
    unit = lambda: expert_load / np.maximum(count, 1)  # noqa: E731
    # A row this close to its lower bound has at most GOOD_ENOUGH to gain: it stops there.
    bound = lower_bound(expert_load, cap, slots.shape[1])
    good_enough = bound * (1 + GOOD_ENOUGH)
    slots = refine(slots, unit(), good_enough=good_enough)[0]
    active = np.arange(len(slots))
    for _ in range(max_rounds):
        active = active[top_load(slots[active], unit()[active]) > bound[active] * (1 + max(settled, GOOD_ENOUGH))]
        if not active.size:
            break
        row, a, i, y = _best_moves(active, slots, expert_load, count, cap)
        unmoved = np.ones(len(slots), dtype=bool)
        unmoved[row] = False
        stuck = active[unmoved[active]]  # active rows without a move (a mask: setdiff1d sorts)
        if stuck.size:  # as refine.py: the wider search only where the narrow one found nothing
            more = _best_moves(stuck, slots, expert_load, count, cap, any_gpu=True)
            row, a, i, y = (np.concatenate(pair) for pair in zip((row, a, i, y), more))
        if not row.size:
            break
        x = slots[row, a, i]
        slots[row, a, i] = y
        count[row, x] -= 1
        count[row, y] += 1
        slots[row] = refine(slots[row], unit()[row], good_enough=good_enough[row])[0]
        active = row
    return slots, count


def _best_moves(active, slots, expert_load, count, cap, any_gpu: bool = False):
    """For each row in `active`, the best replica move, if one lowers its most loaded GPU.

    The slot given up is one of the most loaded GPU's, or with `any_gpu` any slot: giving a hot
    expert its last missing replica on another GPU lowers its share on the top GPU too.
    Returns (row, GPU of the slot, position there, new id), one entry per row that has one.
    """
    n, (_, gpus, c), ids = len(active), slots.shape, expert_load.shape[1]
    here = np.arange(n)
    held = slots[active]  # (n, gpus, c)
    cnt, weight = count[active], expert_load[active]  # (n, ids)
    holds = np.zeros((n, gpus, ids), dtype=bool)
    holds[here[:, None, None], np.arange(gpus)[None, :, None], held] = True
    share = weight / np.maximum(cnt, 1)
    load = np.take_along_axis(share, held.reshape(n, -1), axis=1).reshape(n, gpus, c).sum(axis=2)  # (n, gpus)
    top = load.argmax(axis=1)
    top_load = load[here, top]
    if any_gpu:
        gpu = np.broadcast_to(np.arange(gpus).repeat(c), (n, gpus * c))  # (n, s): every slot
        x = held.reshape(n, -1)
    else:
        gpu = np.broadcast_to(top[:, None], (n, c))  # (n, s): the top GPU's slots
        x = held[here, top]
    s = x.shape[1]
    cx = np.take_along_axis(cnt, x, axis=1)
    lx = np.take_along_axis(weight, x, axis=1)
    gain_x = np.where(cx >= 2, lx / np.maximum(cx - 1, 1) - lx / cx, 0.0)  # (n, s): more on x's other GPUs
    # Candidates for the new replica: the MOVE_CANDIDATES ids with the highest load per replica
    # that may take one more (another replica helps a hot id most).
    open_ = (cnt >= 1) & (cnt < cap)  # (n, ids)
    k = min(WIDE_MOVE_CANDIDATES if any_gpu else MOVE_CANDIDATES, ids)
    cand = np.argsort(np.where(open_, -share, np.inf), axis=1, kind="stable")[:, :k]  # (n, k)
    cy, ly = np.take_along_axis(cnt, cand, axis=1), np.take_along_axis(weight, cand, axis=1)
    gain_y = ly / (cy + 1) - ly / np.maximum(cy, 1)  # (n, k): less on y's GPUs (<= 0)
    hy = np.take_along_axis(holds, np.broadcast_to(cand[:, None, :], (n, gpus, k)), axis=2)  # (n, gpus, k)
    hx = np.take_along_axis(holds, np.broadcast_to(x[:, None, :], (n, gpus, s)), axis=2).transpose(0, 2, 1)  # (n, s, gpus)
    # (n, s, k, gpus): every GPU's load after slot s goes from x to candidate y
    new = (load[:, None, None, :] + hx[:, :, None, :] * gain_x[:, :, None, None]
           + hy.transpose(0, 2, 1)[:, None, :, :] * gain_y[:, None, :, None])
    at = np.broadcast_to(gpu[:, :, None, None], (n, s, k, 1))
    there = np.take_along_axis(new, at, axis=3)[..., 0]
    # The slot's own GPU loses x entirely (not x's larger share) and gains y's new share.
    there = there - (gain_x + lx / cx)[:, :, None] + (ly / (cy + 1))[:, None, :]
    np.put_along_axis(new, at, there[..., None], axis=3)
    worst = new.max(axis=3)  # (n, s, k)
    y_there = np.take_along_axis(hy, np.broadcast_to(gpu[:, :, None], (n, s, k)), axis=1)  # (n, s, k): y on that GPU already
    allowed = (cx >= 2)[:, :, None] & np.take_along_axis(open_, cand, axis=1)[:, None, :] & ~y_there
    worst = np.where(allowed, worst, np.inf)
    best = worst.reshape(n, -1).argmin(axis=1)
    i, j = np.unravel_index(best, (s, k))
    y = cand[here, j]
    gains = worst[here, i, j] < top_load * (1 - _RELATIVE_GAIN)
    g = gpu[here, i]
    position = i % c if any_gpu else i
    return active[gains], g[gains], position[gains], y[gains]


def improve_with_kicks(slots: np.ndarray, expert_load: np.ndarray, count: np.ndarray, cap: int, kicks: int,
                       seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`improve`, then `kicks` times: in each row, swap two random replicas between two GPUs,
    or (every other kick) move a random replica to another expert (a step uphill, out of a
    local optimum), improve again, keep per row the best seen.

    Seeded, so the same loads give the same placement. Never worse than `improve` alone.
    """
    slots, count = improve(slots, expert_load, count, cap)
    rows, gpus, c = slots.shape
    if gpus < 2:
        return slots, count
    rng = np.random.default_rng(seed)
    every_row = np.arange(rows)
    top = lambda s, n: top_load(s, expert_load / np.maximum(n, 1))  # noqa: E731
    best_top = top(slots, count)
    current, current_count = slots, count
    for kick in range(kicks):
        trial, trial_count = current.copy(), current_count.copy()
        a = rng.integers(gpus, size=rows)
        i = rng.integers(c, size=rows)
        x = trial[every_row, a, i]
        if kick % 2:  # a random replica move: x's slot on GPU a goes to y
            y = rng.integers(expert_load.shape[1], size=rows)
            cy = trial_count[every_row, y]
            ok = (trial_count[every_row, x] >= 2) & (cy >= 1) & (cy < cap) & ~(trial[every_row, a] == y[:, None]).any(axis=1)
            trial[every_row[ok], a[ok], i[ok]] = y[ok]
            trial_count[every_row[ok], x[ok]] -= 1
            trial_count[every_row[ok], y[ok]] += 1
        else:  # a random swap between GPUs a and b
            b = (a + rng.integers(1, gpus, size=rows)) % gpus
            j = rng.integers(c, size=rows)
            y = trial[every_row, b, j]
            clash = (trial[every_row, b] == x[:, None]).any(axis=1) | (trial[every_row, a] == y[:, None]).any(axis=1)
            trial[every_row, a, i] = np.where(clash, x, y)
            trial[every_row, b, j] = np.where(clash, y, x)
        trial, trial_count = improve(trial, expert_load, trial_count, cap)
        trial_top = top(trial, trial_count)
        better = trial_top < best_top * (1 - _RELATIVE_GAIN)
        slots, count = slots.copy(), count.copy()
        slots[better], count[better], best_top[better] = trial[better], trial_count[better], trial_top[better]
        current, current_count = trial, trial_count  # walk on from the kicked optimum
    return slots, count


def lower_bound(expert_load: np.ndarray, cap: int, gpus: int) -> np.ndarray:
    """(rows,): no placement's top GPU load is lower: the mean GPU load, and the heaviest id's
    load over the most replicas it may have (each on its own GPU)."""
    return np.maximum(expert_load.sum(axis=1) / gpus, expert_load.max(axis=1) / cap)


def top_load(slots: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """(rows,): the most loaded GPU's load, `unit` (rows, ids) the load of one replica of each id."""
    rows = len(slots)
    return np.take_along_axis(unit, slots.reshape(rows, -1), axis=1).reshape(slots.shape).sum(axis=2).max(axis=1)
