"""Predicted vs measured on `phalanx serve` itself, on this machine: the serving planner's
TTFT and TPOT against a real server's, at 1 process and at 2 (tp=2), at a few Poisson rates.

First the engine's constants are fitted from a short timing of its own steps in this process
(`phalanx calibrate --serve`'s measurement, planner/serve_fit.py), on the benchmark's model;
then a real `phalanx serve` (one thread per process, as the HTTP tests run it) gets seeded
Poisson arrivals through HTTP, each request streamed and timed; the planner predicts the same
layout, block pool, batch limits and load (`serve_search.evaluate`). What the engine's steps
alone do not show is probed on each server before the rates with `phalanx calibrate --serve`'s
own probe (phalanx/calibrate/serve_probe.py, planner/serve_fit.fit_probe): after a warm-up
request, three requests one at a time (and at 1 process four at once) give the per-step and
per-sequence costs of streaming each token through the server's thread and the per-request
HTTP path (1 process), and the tp group's per-step cost (2 processes); the per-request cost is
the 1-process one, as the calibration file holds one. Prints per run the
median TTFT and TPOT, measured and predicted, their errors, and the median |error| over runs
(target 20%). On a shared machine the measured figures move with the load: `uptime` is
printed before and after.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_planner_local.py [--requests 12] [--rates 1,3]
"""

from __future__ import annotations

import argparse
import asyncio
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

    from phalanx.calibrate.serve_probe import probe_running
    from phalanx.calibrate.serve_steps import engine_splits_forwards, measure
    from phalanx.planner.serve_fit import fit, fit_probe
    from tests.serve_server import ServeProcess

    print(f"load before: {os.getloadavg()[0]:.1f} (1-minute average, {os.cpu_count()} cores)", flush=True)
    folder = write_model(Path(tempfile.mkdtemp(prefix="serve-planner-")), args)
    model = model_from_name(str(folder))
    cluster = cluster_from_name("local")
    torch.set_num_threads(1)  # as each server process runs (tests/serve_server.ONE_THREAD)
    steps = measure(model, log=lambda line: print(line, file=sys.stderr, flush=True))
    costs, fit_error = fit(model, cluster, steps, ServeLayout(weight_dtype="fp32", kv_dtype="fp32"),
                           split_forwards=engine_splits_forwards())
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
            # The probe (calibrate's): what the engine steps alone do not show, on this server.
            address = ("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
            probe = asyncio.run(probe_running(address, server.name, tp=procs, vocab=args.vocab, isl=args.isl,
                                              osl=args.osl, max_num_seqs=seqs, max_batch_tokens=mbt))
            costs = fit_probe(model, cluster, costs, probe)
            print(f"probe at {procs} process(es), requests one at a time: TTFT {probe.ttft_s * 1e3:.1f} ms, TPOT "
                  f"{probe.tpot_s * 1e3:.1f} ms; per step {costs.step_s * 1e3:.1f} ms, per sequence "
                  f"{costs.sequence_s * 1e3:.1f} ms, request {costs.request_s * 1e3:.1f} ms, group step "
                  f"{costs.group_step(procs) * 1e3:.1f} ms", flush=True)
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
