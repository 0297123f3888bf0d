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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phalanx.balance import measure  # noqa: E402
from phalanx.balance.loads import read_load  # noqa: E402
from phalanx.balance.placement import check_problem, greedy  # noqa: E402
from phalanx.balance.solve import rebalance  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


if __name__ == "__main__":
    main()
