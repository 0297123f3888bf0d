"""`phalanx plan --serve ...`: the serving planner's command line (torch-free).

`plan --serve` (and `simulate --serve`) take their own flags: `serve_parser` builds that
grammar, and phalanx/cli.py registers it as the `plan` and `simulate` parsers' `--serve` form
(`Command.alternate`), so `plan`'s parser hands its arguments to it when they hold `--serve`,
before the training grammar would ask for `--global-batch`. Training-only flags are refused
by name.
"""

from __future__ import annotations

import argparse
import json
import sys

from phalanx.errors import UserError
from phalanx.planner.hardware import cluster_from_name
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.serve.disagg import disaggregated
from phalanx.planner.serve.flags import add_serve_flags, check_lengths, dtypes_for, load_from
from phalanx.planner.serve.report import explain, serve_record, table
from phalanx.planner.serve.search import parse_serve_fix, search_serving
from phalanx.planner.serve.sim_report import add_simulate_flags, run_serve_simulate

def serve_parser(command: str) -> argparse.ArgumentParser:
    """The grammar of `phalanx plan --serve` or `phalanx simulate --serve` (`command`), with the
    function that runs it as its `func` default, as every subcommand's parser has."""
    parser = argparse.ArgumentParser(prog=f"phalanx {command} --serve",
                                     description="Rank serving layouts of N GPUs by goodput (docs/serve_planner.md)."
                                     if command == "plan" else "Run the best serving layout through the "
                                     "discrete-event simulator (docs/serve_planner.md).")
    add_serve_flags(parser)
    if command == "simulate":
        add_simulate_flags(parser)
        parser.set_defaults(func=run_serve_simulate)
    else:
        parser.set_defaults(func=run_serve_plan)
    return parser


def run_serve_plan(args) -> int:
    model = model_from_name(args.model)
    load = load_from(args, model)
    check_lengths(load, model)
    clusters = [cluster_from_name(name) for name in (args.cluster or ["local"])]
    fixed = parse_serve_fix(args.fix)
    if args.top < 1:
        raise UserError(f"--top={args.top} must be at least 1 (plans to print)")
    if args.disaggregate == "on" and load.phase != "both":
        raise UserError(f"--disaggregate on splits GPUs between both phases; --phase {load.phase} rates one side alone")
    results = []
    for cluster in clusters:
        cluster.check_device_count(args.gpus)
        weight, kv = dtypes_for(args, cluster)
        result = search_serving(model, cluster, load, gpus=args.gpus, fixed=fixed, weight_dtype=weight, kv_dtype=kv,
                                keep=args.top)
        if load.phase == "both" and args.disaggregate != "off":
            split, rated = disaggregated(model, cluster, load, gpus=args.gpus, fixed=fixed, weight_dtype=weight,
                                         kv_dtype=kv)
            result.considered += rated
            both = (result.ranked if args.disaggregate == "auto" else []) + split
            result.ranked = sorted(both, key=lambda plan: plan.key, reverse=True)[:args.top]
        if not result.considered:
            raise UserError(f"no serving layout of {args.gpus} GPUs matches --fix {args.fix} on {cluster.name} "
                            f"(tp divides n_heads={model.n_heads} and stays within a fast domain of "
                            f"{cluster.fast_domain}, ep divides dp and the expert slots (at least "
                            f"n_experts={model.n_experts}, at most n_experts per rank), "
                            f"pp at most n_layers={model.n_layers}; world = instances x dp x tp x pp)")
        results.append((cluster, result))
    if args.json:
        out = [{"cluster": c.name, "considered": r.considered, "pruned_memory": r.pruned_memory,
                "search_seconds": r.seconds, "plans": [serve_record(p, args.model) for p in r.ranked]}
               for c, r in results]
        print(json.dumps(out[0] if len(out) == 1 else {"clusters": out}, indent=2))
        return 0 if all(r.ranked for _, r in results) else 1
    what = {"both": "", "prefill": ", prefill only", "decode": ", decode only"}[load.phase]
    loaded = (f", {load.rate:g} req/s" if load.rate else f", concurrency {load.concurrency}" if load.concurrency else "")
    for cluster, result in results:
        print(f"serving {model.name} on {args.gpus} x {cluster.name}, isl {load.isl} / osl {load.osl}{loaded}{what}")
        if result.ranked:
            print(table(result.ranked))
            print()
            print("\n".join(explain(result.ranked, tpot_ms=load.tpot_ms, ttft_ms=load.ttft_ms)))
            print(f"best plan: {serve_record(result.ranked[0], args.model)['serve']}"
                  + (f"  (x{result.ranked[0].instances} instances)" if result.ranked[0].instances > 1 else ""))
        print(f"{result.considered} layouts considered, {result.pruned_memory} pruned for memory, "
              f"search took {result.seconds:.2f} s")
        print()
    if not all(r.ranked for _, r in results):
        pinned = f" (or the --fix max_batch={fixed['max_batch']} sequences)" if "max_batch" in fixed else ""
        print(f"no serving layout holds one sequence of isl + osl tokens{pinned} in its KV cache; try more GPUs, "
              "fp8 weights or a shorter context", file=sys.stderr)
        return 1
    return 0

