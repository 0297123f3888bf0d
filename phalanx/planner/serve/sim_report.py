"""`phalanx simulate --serve`: the planner's best layout (or the `--fix` one) run through the
discrete-event simulator (serve/simulate.py) at a sweep of Poisson rates; writes a Chrome
trace of the run at `--rate` (trace.json: every rank's steps, every request's life), a PNG of
TTFT and TPOT percentiles against the request rate beside the closed-form predictions
(latency.png), and the figures as JSON (summary.json). Torch-free."""

from __future__ import annotations

import json
from pathlib import Path

from phalanx.errors import UserError
from phalanx.planner.hardware import cluster_from_name
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.serve.flags import check_lengths, dtypes_for, load_from
from phalanx.planner.serve.costs import serve_costs_for
from phalanx.planner.serve.memory import BLOCK_SIZE
from phalanx.planner.serve.rates import ServeLoad
from phalanx.planner.serve.search import ServePlan, evaluate, parse_serve_fix, search_serving
from phalanx.planner.serve.simulate import SimResult, percentile, poisson_arrivals, simulate, step_model_seconds

RATE_FRACTIONS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.2)
MAX_SIMULATED_TOKENS = 5_000_000
"""Output tokens simulated over the whole sweep (requests x --osl x rates): the simulator
took ~30 us per token on a busy 2-core machine (benchmarked with llama3-8b on dgx-h100, 200 to
2000 requests, osl 64 to 640), so this bounds a run to a few minutes; the default sweep of 200
requests reaches it only past --osl 3500."""
"""The sweep, as fractions of the deployment's predicted capacity, when --rates is not given."""


def add_simulate_flags(p) -> None:
    p.add_argument("--requests", type=int, default=200, help="requests per simulated rate")
    p.add_argument("--rates", default="", help="comma-separated request rates to sweep (default: around capacity)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--out", default="simulation", help="directory for trace.json, latency.png, summary.json")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--rates {text!r} is not a comma-separated list of numbers") from None
    if not rates or any(not (r > 0 and r != float("inf")) for r in rates):
        raise UserError(f"--rates {text!r}: every rate must be a positive number")
    return rates


def run_instance(plan: ServePlan, model, cluster, *, rate: float, requests: int, isl: int, osl: int, seed: int,
                 world: int) -> SimResult:
    """One instance of `plan` under its share (1/instances) of `rate`."""
    lay = plan.layout
    blocks = int(plan.memory.kv_tokens // BLOCK_SIZE)
    seconds = step_model_seconds(model, cluster, lay, world=world if cluster.shared_compute else lay.gpus,
                                 costs=serve_costs_for(cluster))
    arrivals = poisson_arrivals(rate / plan.instances, requests, isl=isl, osl=osl, seed=seed)
    return simulate(arrivals, ranks=lay.dp, lockstep=lay.ep > 1, num_blocks=blocks, block_size=BLOCK_SIZE,
                    max_batch=plan.max_batch, max_batch_tokens=plan.max_batch_tokens, step_seconds=seconds, seed=seed)


def summary(result: SimResult) -> dict:
    ttft, tpot = result.ttfts(), result.tpots()
    return {"ttft_ms_p50": percentile(ttft, 50) * 1e3, "ttft_ms_p99": percentile(ttft, 99) * 1e3,
            "tpot_ms_p50": percentile(tpot, 50) * 1e3, "tpot_ms_p99": percentile(tpot, 99) * 1e3,
            "completed": len(result.completed), "preemptions": result.preemptions, "steps": len(result.steps)}


def write_trace(result: SimResult, path: Path, *, title: str) -> None:
    """Chrome trace (chrome://tracing, Perfetto): process 0 has a row per dp rank with its
    steps, process 1 the requests (queued, then running), on 32 lanes."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"{title}: dp ranks"}},
              {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "requests"}}]
    for s in result.steps:
        events.append({"name": f"{s.decodes} decodes + {s.prompt_tokens} prompt", "ph": "X", "pid": 0, "tid": s.rank,
                       "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6,
                       "args": {"decodes": s.decodes, "prompt_tokens": s.prompt_tokens, "preempted": s.preempted}})
    for i, seq in enumerate(result.requests):
        if seq.first_token_at is None or seq.finished_at is None:
            continue
        lane = i % 32
        events.append({"name": f"{seq.seq_id} waiting+prefill", "ph": "X", "pid": 1, "tid": lane,
                       "ts": seq.arrival * 1e6, "dur": (seq.first_token_at - seq.arrival) * 1e6})
        events.append({"name": f"{seq.seq_id} decoding", "ph": "X", "pid": 1, "tid": lane,
                       "ts": seq.first_token_at * 1e6, "dur": (seq.finished_at - seq.first_token_at) * 1e6,
                       "args": {"preemptions": seq.preemptions}})
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def write_png(sweep: list[dict], path: Path, *, title: str) -> None:
    # Imported when run, not at the top: it brings in matplotlib, which start-up need not wait for.
    import matplotlib

    matplotlib.use("Agg")
    # Imported when run, not at the top: it brings in matplotlib, which start-up need not wait for.
    import matplotlib.pyplot as plt

    rates = [row["rate"] for row in sweep]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for axis, metric in ((left, "ttft"), (right, "tpot")):
        for q, style in (("p50", "o-"), ("p99", "s-")):
            axis.plot(rates, [row["simulated"][f"{metric}_ms_{q}"] for row in sweep], style, label=f"simulated {q}")
        key = "ttft_ms" if metric == "ttft" else "tpot_ms_p50"
        axis.plot(rates, [row["predicted"][key] for row in sweep], "k--", label="closed form" + ("" if metric == "ttft" else " p50"))
        axis.set_xlabel("request rate (req/s)")
        axis.set_ylabel(f"{metric.upper()} (ms)")
        axis.set_yscale("log")
        axis.grid(True, alpha=0.3)
        axis.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_serve_simulate(args) -> int:
    model = model_from_name(args.model)
    load = load_from(args, model)
    if args.concurrency is not None or load.phase != "both":
        raise UserError("simulate --serve runs Poisson arrivals of both phases: give --rate, not --concurrency or --phase")
    if args.requests < 1:
        raise UserError(f"--requests={args.requests} must be at least 1")
    if args.cluster and len(args.cluster) > 1:
        raise UserError("simulate --serve takes one --cluster")
    check_lengths(load, model)
    cluster = cluster_from_name((args.cluster or ["local"])[0])
    cluster.check_device_count(args.gpus)
    weight, kv = dtypes_for(args, cluster)
    result = search_serving(model, cluster, load, gpus=args.gpus, fixed=parse_serve_fix(args.fix),
                            weight_dtype=weight, kv_dtype=kv, keep=1)
    if not result.ranked:
        raise UserError(f"no serving layout of {args.gpus} GPUs{' with --fix ' + args.fix if args.fix else ''} holds "
                        f"one sequence of {load.isl} + {load.osl} tokens")
    plan = result.ranked[0]
    capacity = evaluate(model, cluster, plan.layout, plan.instances, ServeLoad(isl=load.isl, osl=load.osl),
                        max_batch=plan.max_batch, max_batch_tokens=plan.max_batch_tokens, world=args.gpus).rates.goodput
    rates = _rates(args.rates) if args.rates else sorted({*(f * capacity for f in RATE_FRACTIONS),
                                                          *([load.rate] if load.rate else [])})
    trace_rate = load.rate or rates[len(rates) // 2]
    count = len({*rates, trace_rate})
    if args.requests * load.osl * count > MAX_SIMULATED_TOKENS:
        raise UserError(f"--requests {args.requests} x --osl {load.osl} x {count} rates = "
                        f"{args.requests * load.osl * count:.3g} simulated tokens; the simulator takes at most "
                        f"{MAX_SIMULATED_TOKENS:.0e} (minutes of work): give fewer --requests or --rates")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out {str(out)!r}: {exc.strerror}") from None
    sweep = []
    for rate in sorted({*rates, trace_rate}):
        sim = run_instance(plan, model, cluster, rate=rate, requests=args.requests, isl=load.isl, osl=load.osl,
                           seed=args.seed, world=args.gpus)
        predicted = evaluate(model, cluster, plan.layout, plan.instances, ServeLoad(isl=load.isl, osl=load.osl, rate=rate),
                             max_batch=plan.max_batch, max_batch_tokens=plan.max_batch_tokens, world=args.gpus).rates
        sweep.append({"rate": rate, "simulated": summary(sim),
                      "predicted": {"ttft_ms": predicted.ttft_s * 1e3, "tpot_ms_p50": predicted.tpot_p50_s * 1e3,
                                    "tpot_ms_p99": predicted.tpot_p99_s * 1e3, "overloaded": predicted.overloaded}})
        if rate == trace_rate:
            title = f"{model.name} {plan.layout.plan_string()} on {cluster.name}, {rate:.3g} req/s"
            write_trace(sim, out / "trace.json", title=title)
    write_png(sweep, out / "latency.png", title=f"{model.name}, {plan.layout.plan_string()} x{plan.instances} on "
              f"{args.gpus} x {cluster.name}, isl {load.isl} / osl {load.osl}")
    (out / "summary.json").write_text(json.dumps({"plan": plan.layout.plan_string(), "instances": plan.instances,
                                                  "max_batch": plan.max_batch, "capacity_req_per_s": capacity,
                                                  "sweep": sweep}, indent=2))
    print(f"simulated {plan.layout.plan_string()} x{plan.instances} (max_batch {plan.max_batch}, budget "
          f"{plan.max_batch_tokens}) at {len(sweep)} rates, {args.requests} requests each; predicted capacity "
          f"{capacity:.3g} req/s")
    for row in sweep:
        s, p = row["simulated"], row["predicted"]
        print(f"  {row['rate']:8.3g} req/s: TTFT p50/p99 {s['ttft_ms_p50']:.4g}/{s['ttft_ms_p99']:.4g} ms "
              f"(closed form {p['ttft_ms']:.4g}), TPOT p50/p99 {s['tpot_ms_p50']:.4g}/{s['tpot_ms_p99']:.4g} ms "
              f"(closed form {p['tpot_ms_p50']:.4g}/{p['tpot_ms_p99']:.4g}), {s['preemptions']} preemptions")
    print(f"wrote {out / 'trace.json'}, {out / 'latency.png'}, {out / 'summary.json'}")
    return 0
