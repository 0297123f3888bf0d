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


def improve(slots: np.ndarray, expert_load: np.ndarray, count: np.ndarray, cap: int,
            max_rounds: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(slots, count) after swaps and replica moves; the inputs are not changed.

    `slots` (rows, gpus, slots per GPU) holds row-local ids; `expert_load` (rows, ids) is each
    id's load (0 for ids naming no expert, which have count 0 and are never given a replica);
    `count` (rows, ids) its replicas; `cap` the most replicas an id may have (GPUs per row).
    """
    count = count.copy()
    unit = lambda: expert_load / np.maximum(count, 1)  # noqa: E731
    slots = refine(slots, unit())[0]
    active = np.arange(len(slots))
    for _ in range(max_rounds):
        row, a, i, y = _best_moves(active, slots, expert_load, count, cap)
        if not row.size:
            break
        x = slots[row, a, i]
        slots[row, a, i] = y
        count[row, x] -= 1
        count[row, y] += 1
        slots[row] = refine(slots[row], unit()[row])[0]
        active = row
    return slots, count


def _best_moves(active, slots, expert_load, count, cap):
    """For each row in `active`, the best move off its most loaded GPU, if one lowers it.

    Returns (row, top GPU, position there, new id), one entry per row that has such a move.
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
    x = held[here, top]  # (n, c): the ids on the top GPU
    cx = np.take_along_axis(cnt, x, axis=1)
    lx = np.take_along_axis(weight, x, axis=1)
    gain_x = np.where(cx >= 2, lx / np.maximum(cx - 1, 1) - lx / cx, np.inf)  # (n, c): more on x's other GPUs
    # Candidates for the new replica: the MOVE_CANDIDATES ids with the highest load per replica
    # that may take one more (another replica helps a hot id most), not on the top GPU already.
    open_ = (cnt >= 1) & (cnt < cap) & ~holds[here, top]  # (n, ids)
    k = min(MOVE_CANDIDATES, ids)
    cand = np.argsort(np.where(open_, -share, np.inf), axis=1, kind="stable")[:, :k]  # (n, k)
    cy, ly = np.take_along_axis(cnt, cand, axis=1), np.take_along_axis(weight, cand, axis=1)
    gain_y = ly / (cy + 1) - ly / np.maximum(cy, 1)  # (n, k): less on y's GPUs (<= 0)
    hy = np.take_along_axis(holds, np.broadcast_to(cand[:, None, :], (n, gpus, k)), axis=2)  # (n, gpus, k)
    hx = np.take_along_axis(holds, np.broadcast_to(x[:, None, :], (n, gpus, c)), axis=2).transpose(0, 2, 1)  # (n, c, gpus)
    # (n, c, k, gpus): every GPU's load after moving slot i of the top GPU from x to candidate y
    new = (load[:, None, None, :] + hx[:, :, None, :] * np.where(np.isinf(gain_x), 0, gain_x)[:, :, None, None]
           + hy.transpose(0, 2, 1)[:, None, :, :] * gain_y[:, None, :, None])
    at_top = top[:, None, None, None].repeat(c, 1).repeat(k, 2)
    on_top = np.take_along_axis(new, at_top, axis=3)[..., 0]
    # The top GPU itself: it loses x entirely (not x's larger share) and gains y's new share.
    on_top = on_top - np.where(np.isinf(gain_x), 0, gain_x + lx / cx)[:, :, None] + (ly / (cy + 1))[:, None, :]
    np.put_along_axis(new, at_top, on_top[..., None], axis=3)
    worst = new.max(axis=3)  # (n, c, k)
    allowed = (cx >= 2)[:, :, None] & np.take_along_axis(open_, cand, axis=1)[:, None, :]
    worst = np.where(allowed, worst, np.inf)
    best = worst.reshape(n, -1).argmin(axis=1)
    i, j = np.unravel_index(best, (c, k))
    y = cand[here, j]
    gains = worst[here, i, j] < top_load * (1 - _RELATIVE_GAIN)
    return active[gains], top[gains], i[gains], y[gains]


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
    top = lambda s, n: _top_load(s, expert_load / np.maximum(n, 1))  # noqa: E731
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


def _top_load(slots: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """(rows,): the most loaded GPU's load."""
    rows = len(slots)
    return np.take_along_axis(unit, slots.reshape(rows, -1), axis=1).reshape(slots.shape).sum(axis=2).max(axis=1)
