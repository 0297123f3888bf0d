"""`phalanx plan --serve ...`: the serving planner's command line (torch-free).

`plan --serve` (and `simulate --serve`) take their own flags, so the main CLI hands an argv
holding `--serve` here before the training parser would ask for `--global-batch`
(`serve_argv`). Training-only flags are refused by name.
"""

from __future__ import annotations

import argparse
import json
import sys

from phalanx.errors import UserError
from phalanx.planner.hardware import Cluster, cluster_from_name
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.serve_disagg import disaggregated
from phalanx.planner.serve_rates import ServeLoad
from phalanx.planner.serve_report import explain, serve_record, table
from phalanx.planner.serve_search import parse_serve_fix, search_serving
from phalanx.serving_bounds import check_counts

TRAINING_FLAGS = ("--global-batch", "--seq-len", "--dtype", "--zero-levels", "--any-runtime", "--tp-overlap",
                  "--sp-regather", "--expert-slots", "--plan")


def serve_argv(argv: list[str]) -> bool:
    """Whether a `phalanx` argv is `plan --serve ...` or `simulate --serve ...`."""
    return len(argv) > 1 and argv[0] in ("plan", "simulate") and "--serve" in argv


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """The flags `plan --serve` and `simulate --serve` share."""
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # what brought the argv here
    p.add_argument("--model", required=True, help="preset name, project JSON or Hugging Face config.json")
    p.add_argument("--cluster", action="append", help="preset or file; repeat to compare clusters (default local)")
    p.add_argument("--gpus", type=int, required=True, help="devices in all")
    p.add_argument("--isl", type=int, required=True, help="prompt (input) tokens per request")
    p.add_argument("--osl", type=int, required=True, help="output tokens per request")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="requests in flight at once (closed loop)")
    load.add_argument("--rate", type=float, help="Poisson arrivals, requests per second, whole deployment")
    p.add_argument("--ttft-ms", type=float, help="target time to first token, ms")
    p.add_argument("--tpot-ms", type=float, help="target time per output token, ms")
    p.add_argument("--phase", choices=("both", "prefill", "decode"), default="both",
                   help="rate one side alone (prefill: input tokens/s; decode at contexts isl to isl + osl)")
    p.add_argument("--weight-dtype", choices=("bf16", "fp8", "fp4", "fp32"), default=None,
                   help="weights and GEMMs (default bf16 on GPUs, fp32 on a CPU as phalanx serve runs)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8", "fp32"), default=None, help="KV cache (default: as activations)")
    p.add_argument("--disaggregate", choices=("auto", "on", "off"), default="auto",
                   help="prefill and decode on separate GPUs (auto: whichever ranks higher)")
    p.add_argument("--fix", default="", help="pin tp=,ep=,dp=,pp=,max_batch=,max_batch_tokens=,instances=")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--top", type=int, default=10, help="plans to print")
    for flag in TRAINING_FLAGS:
        p.add_argument(flag, dest="training_" + flag[2:].replace("-", "_"), nargs="?", const=True,
                       default=None, help=argparse.SUPPRESS)


def load_from(args) -> ServeLoad:
    for flag in TRAINING_FLAGS:
        if getattr(args, "training_" + flag[2:].replace("-", "_")) is not None:
            raise UserError(f"{flag} belongs to training plans; with --serve give --isl/--osl, --weight-dtype/--kv-dtype "
                            "and a serving --fix")
    checks = [("--gpus", args.gpus, 1), ("--isl", args.isl, 1), ("--osl", args.osl, 1)]
    if args.concurrency is not None:
        checks.append(("--concurrency", args.concurrency, 1))
    for name, value, least in checks:
        if value < least:
            raise UserError(f"{name}={value} must be at least {least}")
    check_counts(isl_plus_osl=args.isl + args.osl, concurrency=args.concurrency)
    for name, value in (("--rate", args.rate), ("--ttft-ms", args.ttft_ms), ("--tpot-ms", args.tpot_ms)):
        if value is not None and not (value > 0 and value != float("inf")):
            raise UserError(f"{name}={value} must be a positive number")
    if args.phase == "prefill" and args.tpot_ms is not None:
        raise UserError("--phase prefill rates prompts alone; --tpot-ms is a decode target")
    if args.phase == "decode" and args.ttft_ms is not None:
        raise UserError("--phase decode rates decoding alone; --ttft-ms is a prefill target")
    return ServeLoad(isl=args.isl, osl=args.osl, concurrency=args.concurrency, rate=args.rate,
                     ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, phase=args.phase)


def dtypes_for(args, cluster: Cluster) -> tuple[str, str]:
    """(weights, KV) dtypes on `cluster`; a dtype its tensor cores lack is an error."""
    weight = args.weight_dtype or ("fp32" if cluster.shared_compute else "bf16")
    kv = args.kv_dtype or ("fp32" if weight == "fp32" else "bf16")
    if weight == "fp8" and not cluster.fp8_tflops and not cluster.shared_compute:
        raise UserError(f"--weight-dtype fp8: cluster {cluster.name!r} has no fp8 tensor cores (fp8_tflops=0)")
    if weight == "fp4" and not cluster.fp4_tflops:
        raise UserError(f"--weight-dtype fp4: cluster {cluster.name!r} has no fp4 tensor cores (fp4_tflops=0); "
                        "dgx-b200 and gb200-nvl72 have")
    return weight, kv


def run_serve_plan(args) -> int:
    load = load_from(args)
    model = model_from_name(args.model)
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
                            f"{cluster.fast_domain}, ep divides dp and n_experts={model.n_experts}, "
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


def main(argv: list[str]) -> int:
    """`plan --serve ...` or `simulate --serve ...` (argv without the program name)."""
    command, rest = argv[0], argv[1:]
    parser = argparse.ArgumentParser(prog=f"phalanx {command} --serve")
    add_serve_flags(parser)
    if command == "simulate":
        from phalanx.planner.serve_sim_report import add_simulate_flags, run_serve_simulate

        add_simulate_flags(parser)
        args = parser.parse_args(rest)
        return run_serve_simulate(args)
    args = parser.parse_args(rest)
    return run_serve_plan(args)
