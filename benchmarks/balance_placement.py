"""Expert placement: balancedness, time and moved slots of phalanx against the reference's greedy
algorithm (DeepSeek EPLB, as described; phalanx/balance/placement.py `greedy(distinct=False)`)
and against no replication, on the same loads in the same run.

    .venv/bin/python benchmarks/balance_placement.py [--run RUN_DIR]

Traces: seeded synthetic loads (Zipf popularity, exponent 1.2, shuffled per layer; log-normal,
sigma 1), several sizes including 58 layers x 256 experts into 288 slots on 32 GPUs over 4 nodes;
and, with --run, the loads a `phalanx train` run of an MoE model recorded (metrics.jsonl).
Balancedness is mean / max GPU load, the mean over layers. Times are the median of 5 calls in CPU
seconds of this process (time.process_time: on a shared machine, wall time counts the others)
(the first, warm-up call not counted). Drift: the loads times log-normal noise (sigma 0.1),
re-planned from scratch and from the previous plan (`previous=`).

Optimality (issue 23 item 8: within 2% of the best placement an optimizing method finds under
the same rules): per layer against an integer program on small cases (scipy's milp, exact where
it says "proved") and against simulated annealing with swaps and replica moves (8 chains from
several group-to-node assignments, benchmarks/placement_optimum.py) on large ones, including the
issue's trace: token counts sampled from Zipf(1.2) over 64 experts (seed 0, unshuffled, so the
hottest experts share a group), 8 layers into 80 slots on 8 GPUs over 2 nodes, 16 groups.
`--quick` skips this section (minutes of CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from phalanx.balance import measure  # noqa: E402
from phalanx.balance.loads import read_load  # noqa: E402
from phalanx.balance.placement import check_problem, greedy  # noqa: E402
from phalanx.balance.solve import rebalance  # noqa: E402
from placement_optimum import integer_program, local_search  # noqa: E402

# (layers, experts, replicas, groups, nodes, gpus, policy)
SIZES = [
    (8, 64, 80, 4, 2, 8, "hierarchical"),
    (8, 64, 80, 4, 2, 8, "global"),
    (24, 128, 160, 8, 2, 16, "hierarchical"),
    (58, 256, 288, 8, 4, 32, "hierarchical"),
    (58, 256, 288, 8, 4, 32, "global"),
]


def synthetic(kind: str, layers: int, experts: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "zipf":
        popularity = 1.0 / np.arange(1, experts + 1) ** 1.2
        return np.stack([rng.permutation(popularity) for _ in range(layers)]) * 1e6
    return rng.lognormal(0.0, 1.0, (layers, experts)) * 1e3


def timed(fn, repeats: int = 5):
    fn()  # warm-up
    times, result = [], None
    for _ in range(repeats):
        start = time.process_time()
        result = fn()
        times.append(time.process_time() - start)
    return result, statistics.median(times)


def compare(name: str, load: np.ndarray, replicas: int, groups: int, nodes: int, gpus: int, policy: str) -> None:
    layers, experts = load.shape
    problem = check_problem(layers, experts, replicas, groups, nodes, gpus, policy)
    reference, t_ref = timed(lambda: greedy(load, problem, distinct=False).phy2log())
    ours, t_ours = timed(lambda: rebalance(load, replicas, groups, nodes, gpus, policy=policy).phy2log)
    none = measure.balancedness(measure.unreplicated_loads(load, gpus))
    b_ref = measure.balancedness(measure.gpu_loads(load, reference, gpus))
    b_ours = measure.balancedness(measure.gpu_loads(load, ours, gpus))
    print(f"{name:<40} {none.mean():>6.4f} {b_ref.mean():>9.4f} {b_ours.mean():>8.4f} {b_ours.mean() / b_ref.mean():>9.4f} "
          f"{(b_ours >= b_ref * (1 - 1e-12)).mean():>8.0%} {int(measure.two_replicas_on_one_gpu(reference, gpus).sum()):>6} "
          f"{int(measure.two_replicas_on_one_gpu(ours, gpus).sum()):>5} {t_ref * 1e3:>8.1f} {t_ours * 1e3:>8.1f}")

    drifted = load * np.random.default_rng(1).lognormal(0.0, 0.1, load.shape)
    ref_again = greedy(drifted, problem, distinct=False).phy2log()
    fresh = rebalance(drifted, replicas, groups, nodes, gpus, policy=policy).phy2log
    again, t_again = timed(lambda: rebalance(drifted, replicas, groups, nodes, gpus, policy=policy, previous=ours).phy2log)
    bal = lambda p: measure.balancedness(measure.gpu_loads(drifted, p, gpus)).mean()  # noqa: E731
    moved_fresh, moved_again = measure.moved_slots(fresh, ours), measure.moved_slots(again, ours)
    DRIFT.append(f"{name:<40} {layers * replicas:>6} {measure.moved_slots(ref_again, reference):>9} {bal(ref_again):>7.4f} "
                 f"{moved_fresh:>9} {bal(fresh):>7.4f} {moved_again:>9} {bal(again):>7.4f} {moved_fresh / max(moved_again, 1):>7.1f}x {t_again * 1e3:>7.1f}")


DRIFT: list[str] = []


def issue_trace() -> np.ndarray:
    """Issue 23's trace: per layer, 100,000 tokens' experts drawn from Zipf(1.2) mod 64, seed 0."""
    rng = np.random.default_rng(0)
    return np.stack([np.bincount((rng.zipf(1.2, 100_000) - 1) % 64, minlength=64) for _ in range(8)]).astype(float)


def optimality() -> None:
    print()
    print("optimality: phalanx against an optimizing method under the same rules (balancedness, mean over layers;")
    print("worst = the lowest per-layer ratio phalanx / optimizer; proved = the integer program's optimum is proven;")
    print("ahead = layers where phalanx beats what the optimizer found, which then counts phalanx's placement as the best)")
    print(f"{'trace':<44} {'method':<16} {'phalanx':>8} {'optimum':>8} {'ratio':>7} {'worst':>7} {'proved':>7} {'ahead':>6} {'s':>6}")
    eplb = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                     [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]], float)
    cases = [("DeepSeek EPLB example 2x12 -> 16 on 8/2 hier", eplb, (16, 4, 2, 8), "milp"),
             ("zipf 4x12 -> 16 on 4/2 hier (6 groups)", synthetic("zipf", 4, 12, 1), (16, 6, 2, 4), "milp"),
             ("lognormal 4x12 -> 16 on 4/2 hier (6 groups)", synthetic("lognormal", 4, 12, 1), (16, 6, 2, 4), "milp"),
             ("zipf 4x6 -> 12 on 4 glob", synthetic("zipf", 4, 6, 2), (12, 1, 1, 4), "milp"),
             ("lognormal 4x8 -> 12 on 4 glob", synthetic("lognormal", 4, 8, 2), (12, 1, 1, 4), "milp"),
             ("issue 23: zipf tokens 8x64 -> 80 on 8/2 hier", issue_trace(), (80, 16, 2, 8), "anneal"),
             ("zipf 8x64 -> 80 on 8/2 hier (4 groups)", synthetic("zipf", 8, 64, 72), (80, 4, 2, 8), "anneal"),
             ("lognormal 8x64 -> 80 on 8/1 glob", synthetic("lognormal", 8, 64, 72), (80, 1, 1, 8), "anneal"),
             ("zipf 58x256 -> 288 on 32/4 hier", synthetic("zipf", 58, 256, 314), (288, 8, 4, 32), "anneal")]
    for name, load, (replicas, groups, nodes, gpus), method in cases:
        layers, experts = load.shape
        problem = check_problem(layers, experts, replicas, groups, nodes, gpus)
        ours = rebalance(load, replicas, groups, nodes, gpus).phy2log
        top = measure.gpu_loads(load, ours, gpus).max(axis=1)
        start = time.process_time()
        if method == "milp":
            solved = [integer_program(row, problem, seconds=60) for row in load]
            best, proved = np.array([x for x, _ in solved]), all(ok for _, ok in solved)
        else:
            best, proved = local_search(load, problem, ours, iterations=4000 if layers * experts > 10_000 else 10_000), False
        ahead = int((top < best * (1 - 1e-9)).sum())
        best = np.minimum(best, top)  # phalanx's own placement is a valid one too
        mean = load.sum(axis=1) / gpus
        ratio = best / top  # = phalanx balancedness / optimizer balancedness, per layer
        print(f"{name:<44} {method:<16} {(mean / top).mean():>8.4f} {(mean / best).mean():>8.4f} {ratio.mean():>7.4f} "
              f"{ratio.min():>7.4f} {'yes' if proved else '-':>7} {f'{ahead}/{layers}':>6} {time.process_time() - start:>6.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the optimality section")
    parser.add_argument("--run", help="a `phalanx train` run directory of an MoE model (or its metrics.jsonl)")
    args = parser.parse_args()
    print("balancedness (mean/max GPU load, mean over layers): none = one replica per expert; ref = reference greedy;")
    print("ours/ref = ratio; >=ref = layers where phalanx is at least the reference; 2-on-1 = (layer, GPU) pairs holding an expert twice")
    print("ms = CPU milliseconds per call (median of 5)")
    print(f"{'trace':<40} {'none':>6} {'reference':>9} {'phalanx':>8} {'ours/ref':>9} {'>=ref':>8} {'2-on-1':>6} {'ours':>5} {'ref ms':>8} {'ours ms':>8}")
    for kind in ("zipf", "lognormal"):
        for layers, experts, replicas, groups, nodes, gpus, policy in SIZES:
            load = synthetic(kind, layers, experts, seed=layers + experts)
            compare(f"{kind} {layers}x{experts} -> {replicas} on {gpus}/{nodes} {policy[:4]}", load, replicas, groups, nodes, gpus, policy)
    if args.run:
        load = read_load(args.run)
        layers, experts = load.shape
        metrics = Path(args.run) / "metrics.jsonl" if Path(args.run).is_dir() else Path(args.run)
        steps = sum('"moe"' in line for line in metrics.read_text().splitlines())
        print(f"phalanx train run {args.run}: {layers} MoE layers x {experts} experts, tokens summed over its {steps} steps")
        for replicas, groups, nodes, gpus, policy in ((experts * 3 // 2, 2, 2, 4, "hierarchical"), (experts * 3 // 2, 2, 2, 4, "global")):
            compare(f"run {layers}x{experts} -> {replicas} on {gpus}/{nodes} {policy[:4]}", load, replicas, groups, nodes, gpus, policy)
    else:
        print("(no --run given: the row for loads recorded by `phalanx train` is skipped)")
    print()
    print("drift: re-planning after the loads drift (x lognormal(0, 0.1)); moved = slots whose expert changed vs the previous plan")
    print(f"{'trace':<40} {'slots':>6} {'ref moved':>9} {'ref bal':>7} {'scr moved':>9} {'scr bal':>7} {'inc moved':>9} {'inc bal':>7} {'fewer':>8} {'inc ms':>7}")
    print("\n".join(DRIFT))
    if not args.quick:
        optimality()


if __name__ == "__main__":
    main()
