"""The V-shaped schedules' order of operations on each pipeline rank, and a timeline that
runs fixed orders. Both place two chunks per rank in a V: rank r holds virtual stages r and
2p-1-r, so the first rank also holds the last stage.

ZB-V (zbv) as PyTorch's ScheduleZBVZeroBubble orders it (Qi et al., "Zero Bubble Pipeline
Parallelism", section 6), on rank r of p with n = max(m, 2p-1) micro-batches:
  1. 2(p-r)-1 forwards of chunk 0;
  2. r times: forward chunk 1, forward chunk 0;
  3. p-r times: forward chunk 1, its input gradient, its weight gradient;
  4. while forwards remain: forward chunk 0 (if any left), input then weight gradient of
     chunk 0, forward chunk 1, input then weight gradient of chunk 1;
  5. r times: input gradients of chunk 0 and chunk 1, weight gradients deferred;
  6. p-r times: input gradient of chunk 0, then the oldest deferred weight gradient of chunk 0;
  7. the deferred weight gradients left, chunk 1's then chunk 0's.
So weight gradients wait only in the cool-down (steps 5-7), at most r + 1 per chunk: the
memory their inputs hold is bounded (peak_memory.py), not the whole step's.


DualPipeV (DeepSeek's "cut-in-half" DualPipe, the `dualpipev.py` of deepseek-ai/DualPipe)
runs, on rank r of p with m >= 2p micro-batches, eight phases:
  1. 2(p-r-1) forwards of chunk 0;
  2. r+1 times: forward chunk 0, forward chunk 1;
  3. p-r-1 times: input-gradient backward of chunk 1 (its weight gradient deferred), that
     weight gradient, forward chunk 1;
  4. m-2p+r+1 times: forward chunk 0 with backward chunk 1, then forward chunk 1 with
     backward chunk 0 (overlapped pairs: one micro-batch's all-to-all hides under the other's
     compute, which cost.py charges; here the pair takes the two operations' time);
  5. p-r-1 times: backward chunk 1, then forward chunk 1 with backward chunk 0;
  6. r+1 times: backward chunk 1, backward chunk 0, the second half of them deferring their
     weight gradients (from the middle one on: before chunk 1's on odd ranks, chunk 0's on even);
  7. p-r-1 times: a deferred weight gradient, then backward chunk 0 deferring its own;
  8. r+1 deferred weight gradients.
Kinds: F forward, B whole backward (input and weight gradients), I input gradient alone,
W a deferred weight gradient (oldest first).
"""

from __future__ import annotations

import functools


def dualpipev_order(rank: int, p: int, m: int) -> list[tuple[str, int, int]]:
    """(kind, micro-batch, virtual stage) in the order rank `rank` runs them."""
    stage = (rank, 2 * p - 1 - rank)
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    deferred: list[tuple[int, int]] = []
    ops: list[tuple[str, int, int]] = []

    def forward(chunk: int) -> None:
        ops.append(("F", count[("F", chunk)], stage[chunk]))
        count[("F", chunk)] += 1

    def backward(chunk: int, defer_weights: bool = False) -> None:
        mb = count[("B", chunk)]
        count[("B", chunk)] += 1
        ops.append(("I" if defer_weights else "B", mb, stage[chunk]))
        if defer_weights:
            deferred.append((mb, stage[chunk]))

    def weights() -> None:
        mb, j = deferred.pop(0)
        ops.append(("W", mb, j))

    rest = p - rank - 1
    for _ in range(2 * rest):
        forward(0)
    for _ in range(rank + 1):
        forward(0)
        forward(1)
    for _ in range(rest):
        backward(1, defer_weights=True)
        weights()
        forward(1)
    for _ in range(m - 2 * p + rank + 1):
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(rest):
        backward(1)
        forward(1)
        backward(0)
    defer = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            defer = True
        backward(1, defer_weights=defer)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            defer = True
        backward(0, defer_weights=defer)
    for _ in range(rest):
        weights()
        backward(0, defer_weights=True)
    for _ in range(rank + 1):
        weights()
    assert not deferred and all(c == m for c in count.values())
    return ops


def zbv_order(rank: int, p: int, m: int) -> list[tuple[str, int, int]]:
    """(kind, micro-batch, virtual stage) in the order rank `rank` runs them under ZB-V."""
    n = max(m, 2 * p - 1)  # PyTorch's order assumes this many; those past m are left out
    stage = (rank, 2 * p - 1 - rank)
    f, b, w = [0, 0], [0, 0], [0, 0]
    counters = {"F": f, "I": b, "W": w}
    ops: list[tuple[str, int, int]] = []

    def op(kind: str, chunk: int) -> None:
        counter = counters[kind]
        ops.append((kind, counter[chunk], stage[chunk]))
        counter[chunk] += 1

    for _ in range(2 * (p - rank) - 1):
        op("F", 0)
    for _ in range(rank):
        op("F", 1)
        op("F", 0)
    for _ in range(p - rank):
        op("F", 1)
        op("I", 1)
        op("W", 1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            op("F", 0)
        op("I", 0)
        op("W", 0)
        op("F", 1)
        op("I", 1)
        op("W", 1)
    for _ in range(rank):
        op("I", 0)
        op("I", 1)
    for _ in range(p - rank):
        op("I", 0)
        op("W", 0)
    while w[1] < b[1]:
        op("W", 1)
    while w[0] < b[0]:
        op("W", 0)
    assert f == b == w == [n, n]
    return [o for o in ops if o[1] < m]


def run_fixed_orders(orders: list[list[tuple[str, int, int]]], place: list[tuple[int, int]],
                     dur: dict[str, float], send_s: float) -> list[tuple[int, str, int, int, float, float]]:
    """Start every rank's operations in its own order, each as soon as its rank is free and
    its input has arrived (the previous virtual stage's forward, the next one's backward, plus
    the send when the two sit on different ranks). Returns (rank, kind, mb, stage, start, end)."""
    n_virtual = len(place)
    done: dict[tuple[str, int, int], float] = {}
    position = [0] * len(orders)
    free = [0.0] * len(orders)
    out = []

    def ready(kind: str, mb: int, j: int) -> float | None:
        if kind == "W":
            return done.get(("B", mb, j))
        if kind == "F":
            if j == 0:
                return 0.0
            t = done.get(("F", mb, j - 1))
            return None if t is None else t + (send_s if place[j - 1][0] != place[j][0] else 0.0)
        if j == n_virtual - 1:
            return done.get(("F", mb, j))
        t = done.get(("B", mb, j + 1))
        return None if t is None else t + (send_s if place[j + 1][0] != place[j][0] else 0.0)

    # No two ranks share anything but their sends, so an operation's start depends only on its
    # own rank's previous operation and its input: sweep the ranks, each running as far as its
    # inputs allow, until all are done (the times are those of any earliest-start-first order).
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                kind, mb, j = order[position[rank]]
                t = ready(kind, mb, j)
                if t is None:
                    break
                start = max(t, free[rank])
                end = start + dur[kind]
                done[("B" if kind == "I" else kind, mb, j)] = end  # the input gradient is what flows on
                position[rank] += 1
                free[rank] = end
                out.append((rank, kind, mb, j, start, end))
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked; this is a bug in the simulator")
    return out


LINEAR_FROM = {"zbv": 3, "dualpipev": 6}
"""From this many ranks on, each further rank adds the same idle time to a V schedule's step
(checked against the full timeline in tests/test_planner_simulate.py): the ramp into and out
of the V grows by one chunk's worth per rank, and nothing else changes."""


def v_bubble(schedule: str, p: int, m: int, f: float, b: float, w: float) -> float:
    """Seconds a zbv or dualpipev step takes beyond m (f + b + w) with p ranks, stage times
    f (forward), b (input gradient, recompute included) and w (weight gradient) of one
    micro-batch: the timeline of `run_fixed_orders` without sends, at a cost a search can pay.

    With at least 2p micro-batches the bubble no longer depends on m (the steady state adds
    no idle time), so it is timed at 2p; it scales with the stage times (timed on f = 1,
    ratios to four digits); and past LINEAR_FROM[schedule] + 1 ranks it grows linearly, so it
    is timed at the two ranks where that starts and extended."""
    if p == 1:
        return 0.0
    scale = f if f > 0 else max(b, w)
    if scale <= 0:
        return 0.0
    rb, rw = float(f"{b / scale:.4g}"), float(f"{w / scale:.4g}")
    rf = 1.0 if f > 0 else 0.0
    if m < 2 * p and p > TIMED_RANKS:
        return scale * _deep_bubble(schedule, p, m, rf, rb, rw)
    if m < 2 * p:
        return scale * _timed_bubble(schedule, p, m, rf, rb, rw)
    start = LINEAR_FROM[schedule]
    if p <= start + 1:
        return scale * _timed_bubble(schedule, p, 2 * p, rf, rb, rw)
    low = _timed_bubble(schedule, start, 2 * start, rf, rb, rw)
    high = _timed_bubble(schedule, start + 1, 2 * start + 2, rf, rb, rw)
    return scale * (high + (p - start - 1) * (high - low))


TIMED_RANKS = 64
"""Deepest pipeline whose timeline `v_bubble` times with fewer than 2p micro-batches: timing
costs about p x 2p operations (8 s at p = 256), and pp may now reach the device count."""


def _deep_bubble(schedule: str, p: int, m: int, f: float, b: float, w: float) -> float:
    """The bubble of p > TIMED_RANKS ranks and m < 2p micro-batches, from timed shallower ones.

    With at least as many ranks as micro-batches each further rank adds the same idle time
    (tests/test_planner_layer_count.py checks it), so it is extended from two timed depths
    exactly. Otherwise the bubble of m = r p micro-batches grows linearly with p at a fixed
    ratio r (piecewise, on lines through the origin): timed at 32 and 64 ranks with that ratio
    and extended, which the same test finds within 2% of the bubble (0.3% of the step) of the
    full timeline at 100 to 160 ranks."""
    if m <= TIMED_RANKS // 2:
        low = max(m, LINEAR_FROM[schedule])
        a, c = _timed_bubble(schedule, low, m, f, b, w), _timed_bubble(schedule, low + 1, m, f, b, w)
        return c + (p - low - 1) * (c - a)
    half, full = TIMED_RANKS // 2, TIMED_RANKS
    a = _timed_bubble(schedule, half, max(1, round(m * half / p)), f, b, w)
    c = _timed_bubble(schedule, full, max(1, round(m * full / p)), f, b, w)
    return c + (p - full) * (c - a) / (full - half)


KIND_CODE = {"F": 0, "B": 1, "I": 2, "W": 3}


@functools.lru_cache(maxsize=64)
def _compiled(schedule: str, p: int, m: int) -> tuple[tuple[int, int, int], ...]:
    """The step's operations in an order where each comes after what it waits for, as
    (kind: 0 F, 1 B, 2 I, 3 W; index of the rank's previous operation; index of its input's
    operation), -1 for none; sends are left out (the cost model adds them apart). Timing any
    stage times is then one pass (`_timed_bubble`). Built with integer keys, without times:
    a rank runs on while what each operation waits for is already placed."""
    order = zbv_order if schedule == "zbv" else dualpipev_order
    n_virtual = 2 * p
    orders = [order(r, p, m) for r in range(p)]
    placed = [-1] * (2 * n_virtual * m)  # (F or B, stage, mb) -> index in the output
    position, last, out = [0] * p, [-1] * p, []
    remaining = sum(len(o) for o in orders)
    while remaining:
        before = remaining
        for rank, ops in enumerate(orders):
            i = position[rank]
            while i < len(ops):
                kind, mb, j = ops[i]
                if kind == "W":
                    dep = placed[(n_virtual + j) * m + mb]
                elif kind == "F":
                    dep = placed[(j - 1) * m + mb] if j else -2
                elif j == n_virtual - 1:
                    dep = placed[j * m + mb]
                else:
                    dep = placed[(n_virtual + j + 1) * m + mb]
                if dep == -1:
                    break
                code = KIND_CODE[kind]
                placed[((n_virtual if code in (1, 2) else 0) + j) * m + mb] = len(out)
                out.append((code, last[rank], dep if dep >= 0 else -1))
                last[rank] = len(out) - 1
                i += 1
            remaining -= i - position[rank]
            position[rank] = i
        if remaining == before:
            raise RuntimeError("pipeline schedule deadlocked; this is a bug in the simulator")
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _timed_bubble(schedule: str, p: int, m: int, f: float, b: float, w: float) -> float:
    ops = _compiled(schedule, p, m)
    durations = (f / 2, (b + w) / 2, b / 2, w / 2)
    end = [0.0] * (len(ops) + 1)  # the last slot stays 0: what index -1 (nothing to wait for) reads
    for i, (kind, previous, dep) in enumerate(ops):
        a, c = end[previous], end[dep]
        end[i] = (a if a > c else c) + durations[kind]
    return max(end) - m * (f + b + w)
