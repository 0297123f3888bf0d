"""The two greedy steps of a placement, each solved for many rows (layers, or layer x node) at once.

* `replicate(load, slots, cap)`: give `slots - experts` extra replicas, one at a time, each to
  the expert whose load per replica is the highest (the lowest index on a tie), skipping the
  experts that already have `cap` replicas.
* `pack(weight, packs, expert)`: put items into packs of equal size, heaviest item first
  (a stable sort: the lower index first on a tie), each into the lightest pack that still has
  room (the lower pack on a tie). With `expert` given, a pack never takes two items of one
  expert; where every pack with room already holds the item's expert, a repair swap makes room
  (see `_repair`).
* `spread(weight, packs, low, high)`: as `pack`, into packs of `low` to `high` items (groups
  onto nodes, where nodes need not hold equal numbers of groups).
* `pack_replicas(unit, replica_expert, gpus)`: `pack` of one row's replicas onto its GPUs, as
  slots (rows, gpus, slots per GPU); `replicas_of(count)` lists the replicas a count vector gives.

These are the steps DeepSeek's EPLB describes (its README and docstrings); with `cap` unbounded
and no `expert`, they are that reference's greedy algorithm, tie-breaking included. The loop runs
over items (tens), never over rows: every step is one numpy operation across all rows.
"""

from __future__ import annotations

import numpy as np


def replicate(load: np.ndarray, slots: int, cap: int | None = None,
              present: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Replicas for `slots` slots: (slot -> expert (rows, slots), replicas per expert (rows, experts)).

    Slot e < (experts in the row) holds expert e; the extra slots follow in the order they were
    handed out. `load` is (rows, experts), non-negative. `present` (rows, experts), when given,
    marks the experts a row has: they are its first ones (ids 0..k-1), the rest are padding that
    gets no replica (rows of a node frame whose nodes hold different numbers of experts). The
    caller ensures each row's experts <= slots <= its experts * cap.
    """
    rows, experts = load.shape
    count = np.ones((rows, experts), dtype=np.int64) if present is None else present.astype(np.int64)
    slot_expert = np.empty((rows, slots), dtype=np.int64)
    slot_expert[:, :experts] = np.arange(experts)
    filled = count.sum(axis=1)  # (rows,): the next slot each row fills
    every_row = np.arange(rows)
    for _ in range(slots - int(filled.min())):
        per_replica = load / np.maximum(count, 1)
        per_replica[count == 0] = -np.inf
        if cap is not None:
            per_replica[count >= cap] = -np.inf
        hottest = per_replica.argmax(axis=1)  # first maximum: the lower index on a tie
        open_ = filled < slots
        slot_expert[every_row[open_], filled[open_]] = hottest[open_]
        count[every_row[open_], hottest[open_]] += 1
        filled += open_
    return slot_expert, count


def spread(weight: np.ndarray, packs: int, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
    """Items into packs of `low` to `high` items each: (pack of each item, its position), (rows, items).

    Heaviest item first (a stable sort) into the lightest pack that has room, except that once
    the items left are just enough to bring every pack up to `low`, only packs below `low` take
    them. The caller ensures packs * low <= items <= packs * high.
    """
    rows, items = weight.shape
    order = np.argsort(-weight, axis=1, kind="stable")
    every_row = np.arange(rows)
    pack_load = np.zeros((rows, packs))
    pack_count = np.zeros((rows, packs), dtype=np.int64)
    item_pack = np.empty((rows, items), dtype=np.int64)
    item_rank = np.empty((rows, items), dtype=np.int64)
    for step in range(items):
        item = order[:, step]
        cost = np.where(pack_count < high, pack_load, np.inf)
        forced = np.maximum(low - pack_count, 0).sum(axis=1) >= items - step  # (rows,)
        cost[forced[:, None] & (pack_count >= low)] = np.inf
        choice = cost.argmin(axis=1)
        item_pack[every_row, item] = choice
        item_rank[every_row, item] = pack_count[every_row, choice]
        pack_load[every_row, choice] += weight[every_row, item]
        pack_count[every_row, choice] += 1
    return item_pack, item_rank


def pack(weight: np.ndarray, packs: int, expert: np.ndarray | None = None, experts: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Items into `packs` equal packs: (pack of each item, its position in the pack), both (rows, items).

    `weight` is (rows, items) with items divisible by packs. `expert` (rows, items) names each
    item's expert (ids below `experts`); when given, no pack holds two items of one expert
    (the caller ensures no expert has more items in a row than there are packs).
    """
    rows, items = weight.shape
    size = items // packs
    if size == 1:  # one item per pack: item i in pack i, as the reference does
        return np.broadcast_to(np.arange(items), (rows, items)).copy(), np.zeros((rows, items), dtype=np.int64)
    order = np.argsort(-weight, axis=1, kind="stable")  # (rows, items), heaviest first
    sorted_weight = np.take_along_axis(weight, order, axis=1)
    every_row = np.arange(rows)
    pack_load = np.zeros((rows, packs))
    room_load = np.zeros((rows, packs))  # pack_load, inf where the pack is full
    pack_count = np.zeros((rows, packs), dtype=np.int64)
    item_pack = np.full((rows, items), -1, dtype=np.int64)
    item_rank = np.full((rows, items), -1, dtype=np.int64)
    # (rows, experts, packs): expert-major, so one step's lookup reads a contiguous row per layer
    holds = np.zeros((rows, experts, packs), dtype=bool) if expert is not None else None
    sorted_expert = np.take_along_axis(expert, order, axis=1) if expert is not None else None
    for step in range(items):
        item = order[:, step]  # (rows,)
        if holds is not None:
            item_expert = sorted_expert[:, step]
            cost = np.where(holds[every_row, item_expert], np.inf, room_load)  # (rows, packs)
        else:
            cost = room_load
        choice = cost.argmin(axis=1)
        stuck = np.isinf(cost[every_row, choice])
        if stuck.any():
            for row in np.flatnonzero(stuck):
                choice[row] = _repair(row, int(item[row]), weight, expert, size, item_pack, item_rank, pack_load, pack_count, holds)
                room_load[row] = np.where(pack_count[row] < size, pack_load[row], np.inf)
        rank = pack_count[every_row, choice]
        item_pack[every_row, item] = choice
        item_rank[every_row, item] = rank
        pack_load[every_row, choice] += sorted_weight[:, step]
        pack_count[every_row, choice] = rank + 1
        room_load[every_row, choice] = np.where(rank + 1 < size, pack_load[every_row, choice], np.inf)
        if holds is not None:
            holds[every_row, item_expert, choice] = True
    return item_pack, item_rank


def pack_replicas(unit: np.ndarray, replica_expert: np.ndarray, gpus: int, distinct: bool = True) -> np.ndarray:
    """Replicas onto GPUs with `pack`: (rows, gpus, slots per GPU), the id in each slot.

    `unit` (rows, ids) is the load one replica of each id carries; `replica_expert` (rows,
    slots) names each replica's id. With `distinct`, no GPU holds an id twice.
    """
    rows, slots = replica_expert.shape
    per_replica = np.take_along_axis(unit, replica_expert, axis=1)  # (rows, slots)
    gpu, position = pack(per_replica, gpus, replica_expert if distinct else None, unit.shape[1])
    placed = np.empty_like(replica_expert)
    np.put_along_axis(placed, gpu * (slots // gpus) + position, replica_expert, axis=1)  # slot = gpu * per GPU + position
    return placed.reshape(rows, gpus, slots // gpus)


def replicas_of(count: np.ndarray) -> np.ndarray:
    """(rows, slots): each row's ids, id k repeated count[k] times, in increasing order."""
    rows, ids = count.shape
    return np.repeat(np.tile(np.arange(ids), rows), count.ravel()).reshape(rows, -1)


def _repair(row, item, weight, expert, size, item_pack, item_rank, pack_load, pack_count, holds) -> int:
    """Make room for `item` in one row where every pack with room already holds its expert.

    Such a pack `open_` exists, and some full pack lacks the expert (it has fewer items placed
    than there are packs). That full pack holds `size` distinct experts while `open_` holds
    fewer than `size`, so one of them, `moved`, is not in `open_`: move it there and give its
    place to `item`. Of all such moves, take the one that leaves the lower of the two packs'
    larger load (the lowest indices on a tie). Returns the pack freed for `item`; that pack's
    count is lowered by one, so the caller's bookkeeping adds the item as usual.
    """
    e = expert[row, item]
    has_room = np.flatnonzero(pack_count[row] < size)
    open_ = int(has_room[np.argmin(pack_load[row, has_room])])
    best = None
    for full in np.flatnonzero((pack_count[row] == size) & ~holds[row, e]):
        for moved in np.flatnonzero(item_pack[row] == full):
            if holds[row, expert[row, moved], open_]:
                continue
            w = weight[row, moved]
            worse = max(pack_load[row, full] - w + weight[row, item], pack_load[row, open_] + w)
            if best is None or worse < best[0]:
                best = (worse, int(full), int(moved))
    _, full, moved = best
    w, moved_expert = weight[row, moved], expert[row, moved]
    freed_rank = item_rank[row, moved]
    item_pack[row, moved], item_rank[row, moved] = open_, pack_count[row, open_]
    pack_load[row, open_] += w
    pack_count[row, open_] += 1
    holds[row, moved_expert, open_] = True
    pack_load[row, full] -= w
    holds[row, moved_expert, full] = False
    # The caller gives the item the last position of `full` (its count after the decrement);
    # the item that held that position takes the freed one, so positions stay 0..size-1.
    last = np.flatnonzero((item_pack[row] == full) & (item_rank[row] == size - 1))
    if last.size:
        item_rank[row, last[0]] = freed_rank
    pack_count[row, full] -= 1
    return full
