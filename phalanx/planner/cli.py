"""The `plan` subcommand (`phalanx/cli.py` registers it with `register`); `plan --serve` has its
own flags (serve/cli.py)."""

from __future__ import annotations

import json
import sys

from phalanx.errors import UserError
from phalanx.planner.hardware import cluster_from_name
from phalanx.planner.layout import Workload
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.plan_flags import add_plan_flags, options_for
from phalanx.planner.energy import OBJECTIVES, check_prices, objective_for, parse_prices
from phalanx.planner.report import columns, explain, format_table, plan_record, table_rows
from phalanx.planner.memory_fit import fit_hints
from phalanx.planner.mixed_cluster import is_mixed_cluster_file
from phalanx.planner.mixed_report import run_mixed_plan
from phalanx.planner.search import SearchSpace, fix_problems, parse_fix, search
from phalanx.planner.validation import step_time_band


def register(subparsers) -> None:
    """Add `plan` to an argparse subparsers object."""
    p = subparsers.add_parser("plan", help="rank parallel layouts by predicted step time")
    add_plan_flags(p)
    p.add_argument("--cluster", action="append", help="preset or file; repeat to compare clusters (default local)")
    p.add_argument("--gpus", type=int, required=True, help="number of devices")
    p.add_argument("--fix", default="", help="pin knobs with the --plan grammar plus mbs= and zero=")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--objective", default="time", choices=OBJECTIVES,
                   help="rank by step time (default), energy per step, or cost per token (needs --price); "
                        "docs/planner.md, Energy and cost")
    p.add_argument("--max-slowdown", type=float, default=None, metavar="F",
                   help="with --objective energy|cost: only plans within F x the fastest plan's step time "
                        "(1.1: up to 10%% slower), the least energy or cost among them first")
    p.add_argument("--serve", action="store_true",
                   help="plan serving instead (its own flags: phalanx plan --serve --help; docs/serve_planner.md)")
    p.set_defaults(func=run_plan)


def run_plan(args) -> int:
    if any(is_mixed_cluster_file(name) for name in args.cluster or ()):
        if len(args.cluster) > 1:
            raise UserError("a mixed cluster file (groups of presets) is planned on its own, not beside other --cluster")
        return run_mixed_plan(args, args.cluster[0])
    model = model_from_name(args.model)
    workload = Workload(global_batch=args.global_batch, seq_len=args.seq_len)
    clusters = [cluster_from_name(name) for name in (args.cluster or ["local"])]
    if args.gpus < 1:
        raise UserError(f"--gpus={args.gpus} must be at least 1")
    if args.top < 1:
        raise UserError(f"--top={args.top} must be at least 1 (rows to print)")
    for cluster in clusters:
        cluster.check_device_count(args.gpus)
    fixed = parse_fix(args.fix)
    prices = parse_prices(args.price)
    check_prices(prices, clusters)
    objectives = {c.name: objective_for(args.objective, args.max_slowdown, c, prices) for c in clusters}
    space = SearchSpace(zero_levels=args.zero_levels, phalanx_trainer=not args.any_runtime)
    results = []
    for cluster in clusters:
        result = search(model, cluster, workload, world_size=args.gpus, fixed=fixed, space=space,
                        options=options_for(args, cluster), keep=args.top, objective=objectives[cluster.name])
        if not result.ranked and result.considered == 0:
            raise UserError(_why_empty(args, fixed, fix_problems(model, workload, args.gpus, fixed, space,
                                                                 expert_slots=args.expert_slots)))
        results.append((cluster, result))
    if args.json:
        out = [{"cluster": c.name, "considered": r.considered, "pruned_memory": r.pruned_memory,
                "search_seconds": r.seconds, "objective": args.objective, "max_slowdown": args.max_slowdown,
                "announced": c.announced,
                "plans": [plan_record(e, step_time_band(c), cluster=c, price=prices.get(c.name), objective=objectives[c.name])
                          for e in r.ranked]}
               for c, r in results]
        print(json.dumps(out[0] if len(out) == 1 else {"clusters": out}, indent=2))
        return 0 if all(r.ranked for _, r in results) else 1
    if len(results) > 1:
        _print_side_by_side(model.name, args, results, prices)
    else:
        cluster, result = results[0]
        print(f"{model.name} on {args.gpus} x {cluster.name}, global batch {args.global_batch} x {args.seq_len} tokens")
        if cluster.announced:
            print(f"{cluster.name}: announced figures, not measured hardware (phalanx/planner/hardware.py)")
        if result.ranked:
            price = prices.get(cluster.name)
            print(format_table(columns(priced=price is not None),
                               table_rows(result.ranked, step_time_band(cluster), cluster=cluster, price=price)))
            print()
            print("\n".join(explain(result, cluster.memory_gib - cluster.memory_reserved_gib, objectives[cluster.name])))
            slots = f" --expert-slots {args.expert_slots}" if args.expert_slots else ""  # what phalanx train needs beside it
            print(f"best plan: --plan {result.ranked[0].layout.plan_string()}{slots}"
                  f"  (mbs={result.ranked[0].layout.mbs}, zero={result.ranked[0].layout.zero})")
        print(f"{result.considered} layouts considered, {result.pruned_memory} pruned for memory "
              f"(> {cluster.memory_gib - cluster.memory_reserved_gib:.1f} GiB usable), "
              f"search took {result.seconds:.2f} s")
    if not all(r.ranked for _, r in results):
        for cluster, result in results:
            if not result.ranked and result.fastest_pruned and args.fix:
                print(_rejected(model, cluster, workload, result.fastest_pruned, options_for(args, cluster)),
                      file=sys.stderr)
        print("no layout fits in memory; try more GPUs, recompute=full or fsdp", file=sys.stderr)
        return 1
    return 0


def _why_empty(args, fixed: dict, reasons: list[str]) -> str:
    text = f"no layout of {args.gpus} GPUs matches"
    if args.fix:
        text += f" --fix {args.fix}"
    if args.expert_slots:
        text += f" with --expert-slots={args.expert_slots}"
    if reasons:
        return f"{text}: {'; '.join(reasons)}"
    return text + (f" with global batch {args.global_batch} (dp x mbs x microbatches must equal it, "
                   "tp must divide the heads and feed-forward size, pp at most the layer count; the phalanx "
                   "trainer also needs tp to divide the KV heads and vocabulary: --any-runtime lifts that)")


def _rejected(model, cluster, workload, est, options) -> str:
    """A --fix layout that does not fit: its GiB per category, and single changes that fit."""
    usable = cluster.memory_gib - cluster.memory_reserved_gib
    parts = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in est.memory_breakdown.items())
    hints = fit_hints(model, cluster, workload, est, options)
    fix = ("; fits with " + " or ".join(hints)) if hints else "; no single change of recompute, zero or mbs fits it"
    return (f"{est.layout.to_string()} on {cluster.name} needs {est.memory_gib:.1f} GiB of {usable:.1f} usable "
            f"({parts} GiB){fix}")


def _print_side_by_side(model_name: str, args, results, prices: dict[str, float]) -> None:
    print(f"best plan for {model_name} on {args.gpus} GPUs, global batch {args.global_batch} x {args.seq_len}"
          + (f", by {args.objective}" if args.objective != "time" else ""))
    names = [c.name + (" (announced)" if c.announced else "") for c, _ in results]
    fields = ["dp", "cp", "tp", "pp", "ep", "mbs", "microbatches", "schedule", "virtual", "recompute", "zero",
              "step_time_s", "step_time_band", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_gib_per_gpu",
              "energy_j_per_token", *(("cost_usd_per_mtok",) if prices else ())]
    rows = []
    records = [plan_record(r.ranked[0], step_time_band(c), cluster=c, price=prices.get(c.name)) if r.ranked else None
               for c, r in results]
    for f in fields:
        row = [f]
        for rec in records:
            v = rec[f] if rec else "no fit"
            row.append(f"{v:.4g}" if isinstance(v, float) else "-" if v is None else str(v))
        rows.append(row)
    for key in records[0]["breakdown"] if records[0] else []:
        rows.append([f"  {key} s"] + [f"{rec['breakdown'][key]:.3g}" if rec else "-" for rec in records])
    rows.append(["pruned for memory"] + [str(r.pruned_memory) for _, r in results])
    print(format_table(["", *names], rows))
    key = {"time": "step_time_s", "energy": "energy_j_per_token", "cost": "cost_usd_per_mtok"}[args.objective]
    scored = [(rec[key], name) for rec, name in zip(records, names) if rec and rec[key] is not None]
    if len(scored) > 1 and args.objective != "time":
        value, name = min(scored)
        print(f"least {args.objective}: {name} ({value:.4g} {'J/token' if args.objective == 'energy' else '$/Mtok'})")
