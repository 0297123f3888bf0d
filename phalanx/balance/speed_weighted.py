"""Expert slots placed for ranks of different speeds: each rank's load in proportion to its speed.

With equal speeds the balancer evens the load each GPU carries (solve.py). When the ranks
differ (an older card, a throttled one, a busy neighbour), a rank's time is its load over its
speed, and the step waits for the slowest: the placement should even the *times*, giving a rank
twice as fast twice the load. Every GPU still holds the same number of slots (the model's
shapes), so the faster rank takes the hotter experts, or more replicas of them.

Per layer, small enough for plain loops (training's ep groups: a handful of ranks, tens of slots):
  1. replica counts as the balancer's greedy step gives them (`packing.replicate`: extra
     replicas to the experts with the most load per replica; a replica carries load / replicas);
  2. replicas placed heaviest first, each on the rank with room, not already holding its
     expert, whose time after taking it is the least (list scheduling on machines of
     different speeds); where every rank with room holds the expert, a swap makes room;
  3. swaps of two slots between the slowest-finishing rank and another, while one lowers the
     larger of their two times (a local search; it ends: the sorted times fall each swap);
  4. other replica counts: a slot of an expert with several replicas given to another expert
     (not on that rank), while one lowers the slowest rank's time, each followed by step 3.
     Counts from the loads alone can leave a slow rank as loaded as a fast one (loads [6, 2, 2,
     2] in 6 slots: two replicas each of experts 0 and 1, one of each on both ranks).
With a previous placement, experts that stay on a rank keep their slot there (few moves), and
the previous placement is kept where it is within `KEEP_WITHIN` of the new one's times.

`times(load, phy2log, speeds)`: each rank's load over its speed, what both measure.
"""

from __future__ import annotations

import numpy as np

from phalanx.balance.incremental import KEEP_WITHIN
from phalanx.balance.measure import gpu_loads, replica_counts
from phalanx.balance.packing import replicate
from phalanx.errors import UserError

MOST_SWAPS = 1_000
"""A bound on step 3's swaps per layer; each lowers the slowest rank's time or a tie below it."""


def check_speeds(speeds, gpus: int) -> np.ndarray:
    array = np.asarray(speeds, dtype=float)
    if array.shape != (gpus,) or not np.all(np.isfinite(array)) or np.any(array <= 0):
        raise UserError(f"rank speeds must be {gpus} positive numbers, got {list(np.atleast_1d(array))}")
    return array / array.max()


def times(load: np.ndarray, phy2log: np.ndarray, speeds: np.ndarray) -> np.ndarray:
    """Each rank's time, (layers, gpus): its load over its speed."""
    return gpu_loads(load, phy2log, len(speeds)) / speeds


def place(load: np.ndarray, slots: int, speeds, previous: np.ndarray | None = None) -> np.ndarray:
    """(layers, slots) placement of `load` (layers, experts) onto len(speeds) ranks."""
    load = np.asarray(load, dtype=float)
    layers, experts = load.shape
    gpus = len(speeds)
    speeds = check_speeds(speeds, gpus)
    if slots % gpus or slots < experts or slots > experts * gpus:
        raise UserError(f"{slots} slots cannot hold {experts} experts evenly over {gpus} ranks, each rank an expert once")
    per_gpu = slots // gpus
    replica_expert, count = replicate(load, slots, cap=gpus)
    rows = []
    for layer in range(layers):
        unit = load[layer] / count[layer]
        ranks = _list_schedule(replica_expert[layer], unit, speeds, per_gpu)
        ranks = _recount(_swap_down(ranks, unit, speeds), load[layer], speeds)
        row = ranks.reshape(-1)
        if previous is not None:
            row = _closer_to(np.asarray(previous[layer]), row, load[layer], speeds)
        rows.append(row)
    return np.array(rows, dtype=np.int64)


def _rank_times(ranks: np.ndarray, unit: np.ndarray, speeds: np.ndarray) -> np.ndarray:
    return unit[ranks].sum(axis=1) / speeds


def _list_schedule(replica_expert: np.ndarray, unit: np.ndarray, speeds: np.ndarray, per_gpu: int) -> np.ndarray:
    """(gpus, per_gpu) experts: heaviest replica first onto the rank it leaves least busy."""
    gpus = len(speeds)
    held: list[list[int]] = [[] for _ in range(gpus)]
    busy = np.zeros(gpus)
    order = sorted(range(len(replica_expert)), key=lambda i: (-unit[replica_expert[i]], i))  # stable: lower index first
    for i in order:
        expert, weight = int(replica_expert[i]), float(unit[replica_expert[i]])
        open_ = [g for g in range(gpus) if len(held[g]) < per_gpu and expert not in held[g]]
        if not open_:  # every rank with room holds this expert: move one of a full rank's experts there
            g = _make_room(held, expert, unit, speeds, per_gpu)
            busy = np.array([unit[h].sum() if h else 0.0 for h in held])
            open_ = [g]
        best = min(open_, key=lambda g: ((busy[g] + weight) / speeds[g], g))
        held[best].append(expert)
        busy[best] += weight
    return np.array(held, dtype=np.int64)


def _make_room(held: list[list[int]], expert: int, unit: np.ndarray, speeds: np.ndarray, per_gpu: int) -> int:
    """A rank with room holds `expert`; a full rank does not (it has fewer replicas than there
    are ranks) and holds an expert the first lacks (it holds per_gpu distinct ones, the first
    fewer): move that one over, freeing a place for `expert`. Returns the freed rank."""
    gpus = len(held)
    open_ = min((g for g in range(gpus) if len(held[g]) < per_gpu), key=lambda g: (unit[held[g]].sum() / speeds[g], g))
    for full in range(gpus):
        if len(held[full]) == per_gpu and expert not in held[full]:
            for moved in held[full]:
                if moved not in held[open_]:
                    held[full].remove(moved)
                    held[open_].append(moved)
                    return full
    raise AssertionError("no rank can make room")  # unreachable: see the docstring


def _swap_down(ranks: np.ndarray, unit: np.ndarray, speeds: np.ndarray) -> np.ndarray:
    """Swap slots between the slowest rank and another while that lowers the larger of the two times."""
    ranks = ranks.copy()
    gpus, per_gpu = ranks.shape
    for _ in range(MOST_SWAPS):
        busy = _rank_times(ranks, unit, speeds)
        top = int(busy.argmax())
        best = None
        for other in range(gpus):
            if other == top:
                continue
            for a in range(per_gpu):
                for b in range(per_gpu):
                    x, y = ranks[top, a], ranks[other, b]
                    if x == y or y in ranks[top] or x in ranks[other]:
                        continue
                    shift = unit[x] - unit[y]
                    worse = max((busy[top] * speeds[top] - shift) / speeds[top],
                                (busy[other] * speeds[other] + shift) / speeds[other])
                    if worse < busy[top] * (1 - 1e-12) and (best is None or worse < best[0]):
                        best = (worse, other, a, b)
        if best is None:
            break
        _, other, a, b = best
        ranks[top, a], ranks[other, b] = ranks[other, b], ranks[top, a]
    return ranks


def _recount(ranks: np.ndarray, load: np.ndarray, speeds: np.ndarray) -> np.ndarray:
    """Step 4: give one replica of a replicated expert to another expert while that lowers the
    slowest rank's time (its units change: a replica carries load / replicas)."""
    gpus, per_gpu = ranks.shape
    experts = len(load)

    def top(candidate: np.ndarray) -> float:
        count = np.bincount(candidate.reshape(-1), minlength=experts)
        return float(((load / count)[candidate].sum(axis=1) / speeds).max())

    for _ in range(MOST_SWAPS):
        now, best = top(ranks), None
        count = np.bincount(ranks.reshape(-1), minlength=experts)
        for g in range(gpus):
            for a in range(per_gpu):
                if count[ranks[g, a]] < 2:
                    continue
                for z in range(experts):
                    if z in ranks[g]:
                        continue
                    candidate = ranks.copy()
                    candidate[g, a] = z
                    value = top(candidate)
                    if value < now * (1 - 1e-12) and (best is None or value < best[0]):
                        best = (value, candidate)
        if best is None:
            return ranks
        count = np.bincount(best[1].reshape(-1), minlength=experts)
        ranks = _swap_down(best[1], load / count, speeds)
    return ranks


def _closer_to(previous: np.ndarray, fresh: np.ndarray, load: np.ndarray, speeds: np.ndarray) -> np.ndarray:
    """The previous placement where its slowest rank is within KEEP_WITHIN of the fresh one's;
    else the fresh one with each rank's experts that it held before kept in their old slots."""
    gpus = len(speeds)
    experts = len(load)
    if replica_counts(previous[None], experts).min() > 0:
        old_top = times(load[None], previous[None], speeds).max()
        new_top = times(load[None], fresh[None], speeds).max()
        if old_top <= new_top * (1 + KEEP_WITHIN):
            return previous.copy()
    out = fresh.reshape(gpus, -1).copy()
    old = previous.reshape(gpus, -1)
    for g in range(gpus):
        staying = [e for e in out[g] if e in old[g]]
        arriving = [e for e in out[g] if e not in old[g]]
        row = [e if e in staying else -1 for e in old[g]]
        row = [e if e != -1 else arriving.pop(0) for e in row]
        out[g] = row
    return out.reshape(-1)
