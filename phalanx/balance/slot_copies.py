"""Which old expert slot each slot of a new placement copies its weights from; torch-free.

A placement question, so it lives with the balancer: the trainer's rebalancer counts the bytes a
move sends with it (`phalanx.balance.rebalancer`), and the weight move itself
(`phalanx.parallel.expert_slot_moves`) follows it, so the two always agree.
"""

from __future__ import annotations

import numpy as np

from phalanx.errors import UserError


def copy_sources(old: np.ndarray, new: np.ndarray, ep: int) -> np.ndarray:
    """(S,) for each slot of the new placement, the slot of the old one whose contents it takes.

    A slot whose expert is unchanged keeps itself; else a slot on the same rank that held the
    expert (a local copy, no traffic); else one of the expert's old replicas, taken in turn
    (the k-th remote copy of expert e reads its (k mod replicas)-th old replica), so the reads
    of a hot expert spread over its holders. `old` and `new` are one layer's slot -> expert rows.
    """
    old, new = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
    if old.shape != new.shape or old.ndim != 1 or old.size % ep:
        raise UserError(f"placements of {old.shape} and {new.shape} slots do not match over ep={ep}")
    per_rank = old.size // ep
    slot_rank = np.arange(old.size) // per_rank
    source = np.arange(old.size)
    turns: dict[int, int] = {}
    for slot in np.flatnonzero(old != new):  # only changed slots: few after an incremental plan
        expert = int(new[slot])
        holders = np.flatnonzero(old == expert)
        if holders.size == 0:
            raise UserError(f"expert {expert} has no slot in the old placement to copy from")
        local = holders[slot_rank[holders] == slot_rank[slot]]
        if local.size:
            source[slot] = local[0]
        else:
            turn = turns.get(expert, 0)
            source[slot], turns[expert] = holders[turn % holders.size], turn + 1
    return source


def remote_copies(old: np.ndarray, new: np.ndarray, ep: int) -> int:
    """Slots (all layers) whose new contents come from another rank: what crosses the network."""
    old, new = np.atleast_2d(old), np.atleast_2d(new)
    per_rank = old.shape[1] // ep
    total = 0
    for old_row, new_row in zip(old, new):
        source = copy_sources(old_row, new_row, ep)
        total += int((source // per_rank != np.arange(old.shape[1]) // per_rank).sum())
    return total
