"""`phalanx balance` against the best placement there is, found by exhaustive search on small cases.

The rules are the balancer's: every expert at least one replica, no GPU holds two replicas of
one expert, equal slots per GPU, and (hierarchical) every group's replicas on one node, nodes
holding any number of groups that leaves each expert a slot. The search below enumerates group
assignments, replica counts and GPU sets (pure Python, branch and bound on the top GPU load),
so its result is the optimum; phalanx must come within 2% of it (the issue's target) in every
layer. Balancedness = mean / max GPU load, computed by one function for both.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from phalanx.balance import measure
from phalanx.balance.count_revision import revise_counts
from phalanx.balance.placement import check_problem, greedy
from phalanx.balance.replica_moves import improve, lower_bound, top_load
from phalanx.balance.solve import rebalance


def _best_top_load(loads: list[float], gpus: int, slots_per_gpu: int) -> float:
    """Lowest possible top GPU load for these experts on `gpus` GPUs of `slots_per_gpu` slots."""
    best = [float("inf")]
    order = sorted(range(len(loads)), key=lambda e: -loads[e])

    def counts(k: int, left: int, chosen: list[int]):
        if k == len(order):
            if left == 0:
                place(0, chosen, [0.0] * gpus, [0] * gpus)
            return
        most = min(gpus, left - (len(order) - k - 1))
        for count in range(1, most + 1):
            counts(k + 1, left - count, chosen + [count])

    def place(k: int, count: list[int], gpu_load: list[float], used: list[int]):
        if max(gpu_load) >= best[0]:
            return
        if k == len(order):
            best[0] = max(gpu_load)
            return
        share = loads[order[k]] / count[k]
        empty = [g for g in range(gpus) if used[g] == 0]
        for gpu_set in itertools.combinations(range(gpus), count[k]):
            # Empty GPUs are interchangeable: fill them in order (a set skipping one is a copy).
            if any(g not in gpu_set for g in empty[:len(set(gpu_set) & set(empty))]):
                continue
            if all(used[g] < slots_per_gpu for g in gpu_set):
                for g in gpu_set:
                    gpu_load[g] += share
                    used[g] += 1
                place(k + 1, count, gpu_load, used)
                for g in gpu_set:
                    gpu_load[g] -= share
                    used[g] -= 1

    counts(0, gpus * slots_per_gpu, [])
    return best[0]


def _optimum(load: np.ndarray, replicas: int, groups: int, nodes: int, gpus: int) -> float:
    """The best balancedness of one layer (`nodes` > 1: hierarchical, else global)."""
    experts, node_gpus, per_gpu = len(load), gpus // nodes, replicas // gpus
    size = experts // groups
    group_experts = [list(load[g * size:(g + 1) * size]) for g in range(groups)]
    best = float("inf")
    for assignment in itertools.product(range(nodes), repeat=groups - 1):
        node_of = (0,) + assignment  # group 0 on node 0: nodes are interchangeable
        top = 0.0
        for node in range(nodes):
            held = [x for g in range(groups) if node_of[g] == node for x in group_experts[g]]
            if not len(held) <= replicas // nodes <= len(held) * node_gpus:
                top = float("inf")
                break
            top = max(top, _best_top_load(held, node_gpus, per_gpu))
            if top >= best:
                break
        best = min(best, top)
    return load.sum() / gpus / best


def _loads(kind: str, layers: int, experts: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "hot group":  # the hottest experts side by side, as sampled Zipf token counts are
        return np.sort(rng.pareto(1.2, (layers, experts)) + 1, axis=1)[:, ::-1] * 100
    if kind == "zipf":
        popularity = 1.0 / np.arange(1, experts + 1) ** 1.2
        return np.stack([rng.permutation(popularity) for _ in range(layers)]) * 1e4
    return rng.lognormal(0.0, 1.0, (layers, experts)) * 100


# (experts, replicas, groups, nodes, gpus): hierarchical with 2 to 4 groups per node; global
# with 2 and 3 slots per GPU.
CASES = {"hierarchical": (12, 16, 6, 2, 4), "global 2 per GPU": (6, 8, 1, 1, 4), "global 3 per GPU": (6, 12, 1, 1, 4)}


@pytest.mark.parametrize("case, kind", [pytest.param(case, kind, id=f"{name}-{kind}")
                                        for name, case in CASES.items() for kind in ("hot group", "zipf", "lognormal")])
def test_within_two_percent_of_the_optimum(case, kind):
    experts, replicas, groups, nodes, gpus = case
    load = _loads(kind, 3, experts, seed=experts + len(kind))
    _check_against_optimum(load, replicas, groups, nodes, gpus)


def test_the_benchmarks_small_global_cases():
    """benchmarks/balance_placement.py's "zipf 4x6 -> 12 on 4 glob" and "lognormal 4x8 -> 12 on
    4 glob" (same generator and seeds), where fixed replica counts left layers 2.6% below."""
    rng = np.random.default_rng(2)
    popularity = 1.0 / np.arange(1, 7) ** 1.2
    _check_against_optimum(np.stack([rng.permutation(popularity) for _ in range(4)]) * 1e6, 12, 1, 1, 4)
    _check_against_optimum(np.random.default_rng(2).lognormal(0.0, 1.0, (4, 8)) * 1e3, 12, 1, 1, 4)


def _check_against_optimum(load, replicas, groups, nodes, gpus):
    result = rebalance(load, replicas, groups, nodes, gpus)
    ours = measure.balancedness(measure.gpu_loads(load, result.phy2log, gpus))
    best = np.array([_optimum(row, replicas, groups, nodes, gpus) for row in load])
    assert (ours <= best * (1 + 1e-9)).all()  # the search is exhaustive: nothing beats it
    assert (ours >= 0.98 * best).all(), (ours, best)


def test_revised_counts_pack_a_hot_node_to_its_mean():
    """One node of 8 GPUs, 64 experts in 72 slots: Zipf(1.2)'s two hottest and 62 from rank 21 on.

    The greedy counts give the two 6 + 4 replicas, 10 on 8 GPUs, so two GPUs carry a share of
    both, and swaps and replica moves end 20% above the mean GPU load (a lower bound on the top
    load); one replica fewer of each (5 + 3, the freed slots to others) packs every GPU to
    within 0.1% of the mean. The count revision must find that (within 1% of the bound).
    """
    popularity = 1.0 / np.arange(1, 257) ** 1.2
    load = np.concatenate([popularity[:2], popularity[20:82]])[None, :] * 1e4
    frame = greedy(load, check_problem(1, 64, 72, 1, 1, 8, "global"))
    weight = frame.node_load(load)
    slots, count = improve(frame.slots, weight, frame.count, 8)
    bound = lower_bound(weight, 8, 8)
    assert top_load(slots, weight / count) > 1.1 * bound  # the case: descent alone stays far above
    slots, count = revise_counts(slots, weight, count, 8)
    assert (count >= 1).all() and count.sum() == 72 and (np.sort(slots, axis=2)[:, :, 1:] != np.sort(slots, axis=2)[:, :, :-1]).all()
    assert top_load(slots, weight / count) <= 1.01 * bound
