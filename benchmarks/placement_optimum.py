"""Reference optimizers for `benchmarks/balance_placement.py`: how far `phalanx balance` is from
the best placement an optimizing method finds under the same rules (every expert at least one
replica, no GPU holding two replicas of one expert, equal slots per GPU, hierarchical: each
group's replicas on one node, nodes holding any number of groups that leaves each expert a slot).

* `integer_program`: the exact optimum of one layer by scipy's `milp` (HiGHS), for small cases.
  A benchmark-only dependency (the `bench` extra), never the balancer's.
* `local_search`: simulated annealing with swaps and replica moves (a slot handed from one expert
  to another), many independent chains, from several group-to-node assignments; for large cases.
  Written apart from phalanx's own refinement (it shares only the greedy start), so it does not
  inherit that code's blind spots.
Both return the top GPU load per layer; balancedness = mean / top.
"""

from __future__ import annotations

import numpy as np

from phalanx.balance.placement import Problem, greedy


def integer_program(load: np.ndarray, problem: Problem, seconds: float = 60.0) -> tuple[float, bool]:
    """(lowest top GPU load of one layer, proved optimal) by a mixed-integer program.

    x[e, p]: expert e on GPU p; y[e, r]: e has r replicas; w[e, p, r] >= x + y - 1 (the share
    load_e / r lands on p only for e's actual r); z[g, k]: group g on node k; minimize T >= each
    GPU's sum of w * load / r. Group 0 sits on node 0 (nodes are interchangeable).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    experts, gpus, c = len(load), problem.gpus, problem.slots_per_gpu
    n = problem.frame_nodes
    groups = problem.groups if n > 1 else 1
    per_node, size = gpus // n, experts // groups
    most = per_node
    nx, ny, nw, nz = experts * gpus, experts * most, experts * gpus * most, groups * n
    X = lambda e, p: e * gpus + p  # noqa: E731
    Y = lambda e, r: nx + e * most + (r - 1)  # noqa: E731
    W = lambda e, p, r: nx + ny + (e * gpus + p) * most + (r - 1)  # noqa: E731
    Z = lambda g, k: nx + ny + nw + g * n + k  # noqa: E731
    T = nx + ny + nw + nz
    rows, lower, upper = [], [], []

    def constraint(terms, lo, hi):
        rows.append(terms)
        lower.append(lo)
        upper.append(hi)

    for e in range(experts):
        constraint({Y(e, r): 1 for r in range(1, most + 1)}, 1, 1)
        constraint({**{X(e, p): 1 for p in range(gpus)}, **{Y(e, r): -r for r in range(1, most + 1)}}, 0, 0)
        for p in range(gpus):
            constraint({X(e, p): 1, Z(e // size, p // per_node): -1}, -np.inf, 0)
            for r in range(1, most + 1):
                constraint({W(e, p, r): 1, X(e, p): -1, Y(e, r): -1}, -1, np.inf)
    for p in range(gpus):
        constraint({X(e, p): 1 for e in range(experts)}, c, c)
        terms = {W(e, p, r): load[e] / r for e in range(experts) for r in range(1, most + 1)}
        constraint({**terms, T: -1}, -np.inf, 0)
    for g in range(groups):
        constraint({Z(g, k): 1 for k in range(n)}, 1, 1)
    matrix = lil_matrix((len(rows), T + 1))
    for i, terms in enumerate(rows):
        for j, v in terms.items():
            matrix[i, j] = v
    cost = np.zeros(T + 1)
    cost[T] = 1
    integrality = np.ones(T + 1)
    integrality[nx + ny:nx + ny + nw] = 0
    integrality[T] = 0
    lo_bound, hi_bound = np.zeros(T + 1), np.ones(T + 1)
    hi_bound[T] = np.inf
    lo_bound[Z(0, 0)] = 1
    result = milp(cost, constraints=LinearConstraint(matrix.tocsr(), lower, upper), integrality=integrality,
                  bounds=Bounds(lo_bound, hi_bound), options={"time_limit": seconds})
    return float(result.x[T]), result.status == 0


def assignments(load: np.ndarray, problem: Problem, phy2log: np.ndarray, keep: int = 6) -> list[np.ndarray]:
    """Group-to-node assignments to search from, (layers, groups) each: the one `phy2log` uses,
    and where few enough to enumerate, the `keep` with the lightest most loaded node."""
    layers, experts = load.shape
    n = problem.frame_nodes
    if n == 1:
        return [np.zeros((layers, 1), dtype=np.int64)]
    size = experts // problem.groups
    node_of_slot = np.arange(problem.replicas) // (problem.replicas // n)
    first_slot = np.argmax(phy2log[:, :, None] == np.arange(0, experts, size), axis=1)  # (layers, groups)
    found = [node_of_slot[first_slot]]
    if n ** (problem.groups - 1) <= 1 << 16:
        from phalanx.balance.node_assignments import lightest_assignments
        from phalanx.balance.placement import group_bounds

        group_load = load.reshape(layers, problem.groups, -1).sum(axis=2)
        best = lightest_assignments(group_load[:1], n, *group_bounds(problem), keep=10**9)  # all, sorted for layer 0
        every = best[0]  # (assignments, groups)
        member = every[:, :, None] == np.arange(n)
        top = np.einsum("lg,agn->lan", group_load, member.astype(float)).max(axis=2)  # (layers, assignments)
        order = np.argsort(top, axis=1, kind="stable")[:, :keep]
        found += list(every[order].transpose(1, 0, 2))
    return found


def local_search(load: np.ndarray, problem: Problem, phy2log: np.ndarray, *, chains: int = 8,
                 iterations: int = 20000, seed: int = 0) -> np.ndarray:
    """(layers,): the lowest top GPU load simulated annealing finds from each start assignment."""
    layers = len(load)
    n = problem.frame_nodes
    best = np.full(layers, np.inf)
    for node_of_group in assignments(load, problem, phy2log):
        frame = greedy(load, problem, node_of_group=node_of_group) if n > 1 else greedy(load, problem)
        node_top = _anneal(frame.slots, frame.node_load(load), frame.count, problem.gpus // n, chains, iterations, seed)
        best = np.minimum(best, node_top.reshape(layers, n).max(axis=1))
    return best


def _anneal(slots, weight, count, cap, chains, iterations, seed):
    """(rows,): per row (a layer's node), the lowest top load over `chains` annealing chains."""
    rows, gpus, c = slots.shape
    rng = np.random.default_rng(seed)
    slots, weight, count = (np.repeat(a, chains, axis=0) for a in (slots, weight, count))
    width, every = weight.shape[1], np.arange(len(slots))
    holds = np.zeros((len(slots), gpus, width), dtype=bool)
    holds[every[:, None, None], np.arange(gpus)[None, :, None], slots] = True
    share = lambda: weight / np.maximum(count, 1)  # noqa: E731
    load = np.take_along_axis(share(), slots.reshape(len(slots), -1), axis=1).reshape(slots.shape).sum(axis=2)
    mean = load.mean(axis=1)
    score = lambda gl: gl.max(axis=1) + 0.05 * (gl ** 2).mean(axis=1) / np.maximum(mean, 1e-30)  # noqa: E731
    current, best = score(load), load.max(axis=1)
    for step in range(iterations):
        temperature = mean * 0.02 * (0.005 ** (step / iterations))
        a, i = rng.integers(gpus, size=len(slots)), rng.integers(c, size=len(slots))
        x = slots[every, a, i]
        new = load.copy()
        if step % 2:  # replica move: slot (a, i) from x to y
            y = rng.integers(width, size=len(slots))
            cx, cy = count[every, x], count[every, y]
            ok = (cx >= 2) & (cy >= 1) & (cy < cap) & ~holds[every, a, y]
            lx, ly = weight[every, x], weight[every, y]
            dx = np.where(ok, lx / np.maximum(cx - 1, 1) - lx / cx, 0)
            dy = np.where(ok, ly / (cy + 1) - ly / np.maximum(cy, 1), 0)
            new += holds[every, :, x] * dx[:, None] + holds[every, :, y] * dy[:, None]
            new[every, a] += np.where(ok, -lx / np.maximum(cx - 1, 1) + ly / (cy + 1), 0)
        else:  # swap slot (a, i) with (b, j)
            b = (a + rng.integers(1, gpus, size=len(slots))) % gpus
            j = rng.integers(c, size=len(slots))
            y = slots[every, b, j]
            ok = (x != y) & ~holds[every, b, x] & ~holds[every, a, y]
            d = np.where(ok, share()[every, x] - share()[every, y], 0)
            new[every, a] -= d
            new[every, b] += d
        trial = score(new)
        accept = ok & ((trial <= current) | (rng.random(len(slots)) < np.exp(-(trial - current) / temperature)))
        r = every[accept]
        if step % 2:
            xa, ya = x[r], y[r]
            slots[r, a[r], i[r]] = ya
            count[r, xa] -= 1
            count[r, ya] += 1
            holds[r, a[r], xa], holds[r, a[r], ya] = False, True
        else:
            xa, ya = x[r], y[r]
            slots[r, a[r], i[r]], slots[r, b[r], j[r]] = ya, xa
            holds[r, a[r], xa], holds[r, b[r], ya] = False, False
            holds[r, a[r], ya], holds[r, b[r], xa] = True, True
        load[r], current[r] = new[r], trial[r]
        best = np.minimum(best, load.max(axis=1))
    return best.reshape(rows, chains).min(axis=1)
