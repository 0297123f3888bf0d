"""Predicted vs measured on `phalanx serve` itself, on this machine: the serving planner's
TTFT and TPOT against a real server's, at 1 process and at 2 (tp=2), at a few Poisson rates.

First the engine's constants are fitted from a short timing of its own steps in this process
(`phalanx calibrate --serve`'s measurement, planner/serve_fit.py), on the benchmark's model;
then a real `phalanx serve` (one thread per process, as the HTTP tests run it) gets seeded
Poisson arrivals through HTTP, each request streamed and timed; the planner predicts the same
layout, block pool, batch limits and load (`serve_search.evaluate`). What the engine's steps
alone do not show is probed on each server before the rates (after one warm-up request), with
three requests sent one at a time (and at 1 process four at once): what a decode step costs beyond the engine's own, from
the TPOTs (at 1 process per step and per sequence, `step_s` and `sequence_s`: streaming each
token through the server's thread; at 2 processes the tp group's `group_step_s`: the forward's
broadcast and gloo collectives on shared cores), then the request's cost beyond its steps
(`request_s`, from the TTFT: the HTTP path). Prints per run the
median TTFT and TPOT, measured and predicted, their errors, and the median |error| over runs
(target 20%). On a shared machine the measured figures move with the load: `uptime` is
printed before and after.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_planner_local.py [--requests 12] [--rates 1,3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_load import _drive, write_model  # noqa: E402
from phalanx.planner.hardware import cluster_from_name  # noqa: E402
from phalanx.planner.model_spec import model_from_name  # noqa: E402
from phalanx.planner.serve_rates import ServeLoad  # noqa: E402
from phalanx.planner.serve_search import evaluate  # noqa: E402
from phalanx.planner.serve_simulate import poisson_arrivals  # noqa: E402
from phalanx.planner.serve_step import ServeLayout  # noqa: E402


def measured(server, args, rate: float, seed: int) -> tuple[float, float]:
    import random

    rng = random.Random(seed)
    arrivals = [a.at for a in poisson_arrivals(rate, args.requests, isl=args.isl, osl=args.osl, seed=seed)]
    requests = [([rng.randrange(args.vocab) for _ in range(args.isl)], args.osl) for _ in arrivals]
    results, _ = asyncio.run(_drive(server.url, server.name, requests, arrivals))
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)


def sequential(server, args, count: int = 3) -> tuple[float, float]:
    """Median TTFT and TPOT of `count` requests sent one after another (the probe)."""
    import random

    rng = random.Random(99)
    out = []
    for _ in range(count):
        results, _ = asyncio.run(_drive(server.url, server.name, [([rng.randrange(args.vocab) for _ in range(args.isl)],
                                                                   args.osl)], [0.0]))
        out.append(results[0])
    return statistics.median(r[0] for r in out), statistics.median(r[1] for r in out)


def burst(server, args, count: int = 4) -> float:
    """Median TPOT of `count` requests sent at once (the probe's second point)."""
    import random

    rng = random.Random(98)
    requests = [([rng.randrange(args.vocab) for _ in range(args.isl)], args.osl) for _ in range(count)]
    results, _ = asyncio.run(_drive(server.url, server.name, requests, [0.0] * count))
    return statistics.median(r[1] for r in results)


def predict(model, cluster, costs, args, *, procs: int, rate: float | None, seqs: int, mbt: int,
            concurrency: int | None = None) -> tuple[float, float]:
    layout = ServeLayout(tp=procs, weight_dtype="fp32", kv_dtype="fp32")
    plan = evaluate(model, cluster, layout, 1, ServeLoad(isl=args.isl, osl=args.osl, rate=rate, concurrency=concurrency),
                    max_batch=seqs, max_batch_tokens=mbt, world=procs, costs=costs)
    return plan.rates.ttft_s, plan.rates.tpot_p50_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--rates", default="1,3", help="Poisson request rates per second")
    p.add_argument("--procs", default="1,2", help="process counts (tp over them)")
    p.add_argument("--isl", type=int, default=64)
    p.add_argument("--osl", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    args = p.parse_args()
    args.moe = False
    import torch

    from phalanx.calibrate.serve_steps import measure
    from phalanx.planner.serve_fit import fit
    from tests.serve_server import ServeProcess

    print(f"load before: {os.getloadavg()[0]:.1f} (1-minute average, {os.cpu_count()} cores)", flush=True)
    folder = write_model(Path(tempfile.mkdtemp(prefix="serve-planner-")), args)
    model = model_from_name(str(folder))
    cluster = cluster_from_name("local")
    torch.set_num_threads(1)  # as each server process runs (tests/serve_server.ONE_THREAD)
    steps = measure(model, log=lambda line: print(line, file=sys.stderr, flush=True))
    costs, fit_error = fit(model, cluster, steps, ServeLayout(weight_dtype="fp32", kv_dtype="fp32"))
    print(f"engine constants fitted on {len(steps)} steps (median fit error {fit_error:.1%}): "
          f"step {costs.step_s * 1e3:.2f} ms, per sequence {costs.sequence_s * 1e3:.3f} ms, per sequence-layer "
          f"{costs.sequence_layer_s * 1e3:.3f} ms, per token {costs.token_s * 1e3:.3f} ms, rate scale {costs.flops_scale:.3g}")
    blocks, mbt, seqs = 256, 512, 32
    errors = []
    print(f"{'procs':>5} {'rate':>5} {'TTFT meas':>10} {'pred':>8} {'err':>6} {'TPOT meas':>10} {'pred':>8} {'err':>6}")
    for procs in [int(x) for x in args.procs.split(",")]:
        flags = ["--num-kv-blocks", str(blocks), "--block-size", "16", "--max-num-batched-tokens", str(mbt),
                 "--max-num-seqs", str(seqs)] + (["--nproc", str(procs), "--plan", f"tp={procs}"] if procs > 1 else [])
        server = ServeProcess(folder, *flags)
        try:
            # The probe: requests one at a time calibrate what the engine steps alone do not show,
            # the HTTP path per request (1 process) and a tp group's per-step cost (2 processes).
            sequential(server, args, count=1)  # warm-up: a fresh server's first request is slower
            ttft0, tpot0 = sequential(server, args)
            pt0, pp0 = predict(model, cluster, costs, args, procs=procs, rate=1e-3, seqs=seqs, mbt=mbt)
            # First what a decode step costs beyond the engine's own, from the TPOT of one
            # sequence and of four at once: per step and per sequence (streaming its token
            # through the server's thread) at 1 process, the tp group's per step at 2; then
            # what TTFT has beyond its steps.
            if procs == 1:
                tpot4 = burst(server, args)
                _, pp4 = predict(model, cluster, costs, args, procs=procs, rate=None, seqs=seqs, mbt=mbt, concurrency=4)
                per_seq = max(0.0, ((tpot4 - pp4) - (tpot0 - pp0)) / 3)
                per_step = max(0.0, tpot0 - pp0 - per_seq)
                costs = dataclasses.replace(costs, step_s=costs.step_s + per_step, sequence_s=costs.sequence_s + per_seq)
            else:
                costs = dataclasses.replace(costs, group_step_s=((procs, max(0.0, tpot0 - pp0)),))
            pt0, _ = predict(model, cluster, dataclasses.replace(costs, request_s=0.0), args, procs=procs, rate=1e-3,
                             seqs=seqs, mbt=mbt)
            costs = dataclasses.replace(costs, request_s=max(0.0, ttft0 - pt0))
            print(f"probe at {procs} process(es), requests one at a time: TTFT {ttft0 * 1e3:.1f} ms, TPOT "
                  f"{tpot0 * 1e3:.1f} ms; per step {costs.step_s * 1e3:.1f} ms, per sequence {costs.sequence_s * 1e3:.1f} ms, request "
                  f"{costs.request_s * 1e3:.1f} ms, group step {costs.group_step(procs) * 1e3:.1f} ms", flush=True)
            for i, rate in enumerate(float(x) for x in args.rates.split(",")):
                ttft, tpot = measured(server, args, rate, seed=i)
                pt, pp = predict(model, cluster, costs, args, procs=procs, rate=rate, seqs=seqs, mbt=mbt)
                e1, e2 = pt / ttft - 1, pp / tpot - 1
                errors += [abs(e1), abs(e2)]
                print(f"{procs:>5} {rate:>5g} {ttft * 1e3:>8.1f}ms {pt * 1e3:>6.1f}ms {e1:>+6.0%} "
                      f"{tpot * 1e3:>8.1f}ms {pp * 1e3:>6.1f}ms {e2:>+6.0%}", flush=True)
        finally:
            server.stop()
    print(f"median |error| over {len(errors)} TTFT and TPOT medians: {statistics.median(errors):.1%} (target 20%)")
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
