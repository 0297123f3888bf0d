"""Refinement: swap replicas between the most loaded GPU and the others while that lowers it.

The greedy packing (heaviest replica first into the lightest GPU) can leave the last GPUs
uneven; a swap of a heavier replica on the most loaded GPU for a lighter one elsewhere moves
their difference `d` across. Each round, in every row (a layer, or a layer's node) at once:
take the row's most loaded GPU `a`; try every (replica on `a`, replica on the least loaded GPU)
pair, and only where none helps, every pair with the WIDE_PARTNERS least loaded GPUs; keep the pairs
where neither expert is then on one GPU twice and both GPUs end below `a`'s old load, and take
the pair whose larger new load is lowest (the first such pair on a tie). A row stops when no
swap lowers its most loaded GPU; every accepted swap lowers the row's sorted loads
lexicographically, so this ends. Swaps stay within a row, so node locality holds, and replica
counts do not change.

The rows' GPU loads can only fall at the top, so balancedness never drops below the greedy
construction it starts from.
"""

from __future__ import annotations

import numpy as np

# A swap must lower the top load by more than rounding noise (relative), or it is not taken.
_RELATIVE_GAIN = 1e-12
WIDE_PARTNERS = 8
FEW_ROWS = 32
"""At most this many rows left: one wide search per round instead of a narrow one first."""
"""GPUs searched for a swap partner where the least loaded one has none: the 8 least loaded."""


def refine(slots: np.ndarray, unit: np.ndarray, max_rounds: int | None = None,
           good_enough: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Improved slots (rows, gpus, slots per GPU) and the number of swaps made.

    `slots` holds row-local expert ids, no id twice on one GPU; `unit` (rows, ids) is the
    load one replica of each id carries (the expert's load / its replicas). A row whose top
    load is at most `good_enough` (rows,) stops there (each swap moves two slots' weights).
    """
    rows, gpus, c = slots.shape
    slots = slots.copy()
    every_gpu = np.arange(gpus)
    item = np.take_along_axis(unit, slots.reshape(rows, -1), axis=1).reshape(rows, gpus, c)
    load = item.sum(axis=2)  # (rows, gpus)
    holds = np.zeros((rows, gpus, unit.shape[1]), dtype=bool)
    holds[np.arange(rows)[:, None, None], every_gpu[None, :, None], slots] = True
    active = np.arange(rows)
    swaps = 0
    for _ in range(max_rounds if max_rounds is not None else 4 * gpus * c * c):
        if good_enough is not None:
            active = active[load[active].max(axis=1) > good_enough[active]]
        if not active.size:
            break
        # Most rounds find their swap with the least loaded GPU; only rows where it has none
        # search the WIDE_PARTNERS least loaded (8x the work), and rows where that fails too are done.
        # With few rows left, a call's fixed cost outweighs the work: the wide search alone.
        if len(active) > FEW_ROWS:
            row, a, i, b, j = _best_swaps(active, slots, item, load, holds, partners=1)
            unswapped = np.ones(rows, dtype=bool)
            unswapped[row] = False
            stuck = active[unswapped[active]]  # active rows without a swap (a mask: setdiff1d sorts)
        else:
            row = a = i = b = j = np.empty(0, dtype=np.int64)
            stuck = active
        if stuck.size:
            more = _best_swaps(stuck, slots, item, load, holds, partners=WIDE_PARTNERS)
            row, a, i, b, j = (np.concatenate(pair) for pair in zip((row, a, i, b, j), more))
        if not row.size:
            break
        x, y = slots[row, a, i], slots[row, b, j]
        delta = item[row, a, i] - item[row, b, j]
        slots[row, a, i], slots[row, b, j] = y, x
        item[row, a, i], item[row, b, j] = item[row, b, j], item[row, a, i]
        load[row, a] -= delta
        load[row, b] += delta
        holds[row, a, x], holds[row, b, y] = False, False
        holds[row, a, y], holds[row, b, x] = True, True
        swaps += len(row)
        active = np.sort(row)
    return slots, swaps


def _best_swaps(active, slots, item, load, holds, partners: int):
    """For each row in `active`, the best swap off its most loaded GPU, if one lowers it.

    Returns (row, top GPU, position there, other GPU, position there), one entry per row
    that has such a swap.
    """
    n, (_, gpus, c) = len(active), slots.shape
    here = np.arange(n)
    row_load = load[active]  # (n, gpus)
    top = row_load.argmax(axis=1)
    top_load = row_load[here, top]
    if partners == 1:
        partner = row_load.argmin(axis=1)[:, None]  # (n, 1)
    elif partners >= gpus:
        partner = np.broadcast_to(np.arange(gpus), (n, gpus))  # (n, gpus)
    else:  # the least loaded GPUs: a swap with a heavier one rarely lowers the top more
        partner = np.argpartition(row_load, partners, axis=1)[:, :partners]  # (n, partners)
    k = partner.shape[1]
    top_item, top_expert = item[active, top], slots[active, top]  # (n, c)
    other_item = item[active[:, None], partner]  # (n, k, c): partner GPUs' slots
    other_expert = slots[active[:, None], partner]  # (n, k, c)
    other_load = row_load[here[:, None], partner]  # (n, k)
    # Searched in float32 (half the memory traffic); the chosen swap is checked in float64.
    # A pair with d <= 0, or on the top GPU itself, leaves a load >= top_load: never chosen.
    # All (n, c, k, c) by broadcasting: top slot, partner GPU, partner slot.
    d = top_item.astype(np.float32)[:, :, None, None] - other_item.astype(np.float32)[:, None, :, :]  # load moved off the top GPU
    worst = np.maximum(top_load.astype(np.float32)[:, None, None, None] - d, other_load.astype(np.float32)[:, None, :, None] + d)
    # Gathered per GPU and broadcast over its slots: far fewer lookups than per slot pair.
    top_expert_there = holds[active[:, None, None], partner[:, None, :], top_expert[:, :, None]]  # (n, c, k)
    other_expert_on_top = holds[active[:, None, None], top[:, None, None], other_expert]  # (n, k, c)
    np.copyto(worst, np.inf, where=top_expert_there[:, :, :, None] | other_expert_on_top[:, None, :, :])
    best = worst.reshape(n, -1).argmin(axis=1)
    i, g, j = np.unravel_index(best, (c, k, c))
    moved = top_item[here, i] - other_item[here, g, j]
    exact = np.maximum(top_load - moved, other_load[here, g] + moved)
    allowed = ~(top_expert_there[here, i, g] | other_expert_on_top[here, g, j])
    gains = allowed & (moved > 0) & (exact < top_load * (1 - _RELATIVE_GAIN))
    return active[gains], top[gains], i[gains], partner[here, g][gains], j[gains]
