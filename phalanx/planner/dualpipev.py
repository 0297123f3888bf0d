"""DualPipeV's order of operations on each pipeline rank, and a timeline that runs fixed orders.

DualPipeV (DeepSeek's "cut-in-half" DualPipe, the `dualpipev.py` of deepseek-ai/DualPipe)
places two chunks per rank in a V (rank r holds virtual stages r and 2p-1-r, like zbv) and
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

    for _ in range(sum(len(o) for o in orders)):
        best = None
        for rank, order in enumerate(orders):
            if position[rank] == len(order):
                continue
            kind, mb, j = order[position[rank]]
            t = ready(kind, mb, j)
            if t is not None and (best is None or max(t, free[rank]) < best[0]):
                best = (max(t, free[rank]), rank, kind, mb, j)
        if best is None:
            raise RuntimeError("pipeline schedule deadlocked; this is a bug in the simulator")
        start, rank, kind, mb, j = best
        end = start + dur[kind]
        done[("B" if kind == "I" else kind, mb, j)] = end  # the input gradient is what flows on
        position[rank] += 1
        free[rank] = end
        out.append((rank, kind, mb, j, start, end))
    return out
