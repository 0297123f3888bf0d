"""The `plan`, `simulate` and `calibrate` subcommands.

The main CLI calls `register(subparsers)`; `python -m phalanx.planner.cli` works on its own.
"""

from __future__ import annotations

import argparse
import json
import sys

from phalanx.errors import UserError
from phalanx.planner.cost import Options, trainer_options
from phalanx.planner.hardware import cluster_from_name
from phalanx.planner.layout import Workload
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.report import COLUMNS, explain, format_table, plan_record, table_rows
from phalanx.planner.search import SearchSpace, fit_hints, fix_problems, parse_fix, search
from phalanx.planner.validation import step_time_band


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ZeRO levels") from None
    if not levels or any(z not in (0, 1, 2, 3) for z in levels):
        raise argparse.ArgumentTypeError(f"ZeRO levels must be among 0,1,2,3, got {text!r}")
    return levels


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name, project JSON or Hugging Face config.json")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--tp-overlap", action="store_true",
                   help="assume TP collectives are pipelined with GEMMs (Megatron's tp-comm-overlap)")
    p.add_argument("--sp-regather", action="store_true",
                   help="sequence parallelism keeps its GEMM inputs sharded and gathers them again in backward "
                        "(Megatron); default: keeps them whole, as the phalanx trainer does")
    p.add_argument("--zero-levels", type=_levels, default=(0, 2, 3),
                   help="ZeRO levels to search (default 0,2,3: what the phalanx trainer runs; 1 for other runtimes)")
    p.add_argument("--any-runtime", action="store_true",
                   help="other implementations: also layouts the phalanx trainer does not run (tp not dividing "
                        "the KV heads or the vocabulary), experts split over tp, Megatron-style mixed precision")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="the phalanx trainer's --dtype the plan is for (memory: fp32 weights and AdamW moments "
                        "either way; bf16 gathers and activations). Default: bf16 on a GPU cluster (its peak is "
                        "the bf16 peak), fp32 on a CPU one (the trainer's default)")
    p.add_argument("--expert-slots", type=int, default=0, metavar="S",
                   help="the phalanx trainer's --expert-slots: S expert slots over each ep group (>= the experts, "
                        "a multiple of ep), S / ep per rank of weights, gradients and optimizer state; only layouts "
                        "the trainer runs slots in (ep > 1, experts under DDP-style data parallelism)")


def register(subparsers) -> None:
    """Add `plan`, `simulate` and `calibrate` to an argparse subparsers object."""
    p = subparsers.add_parser("plan", help="rank parallel layouts by predicted step time")
    _common(p)
    p.add_argument("--cluster", action="append", help="preset or file; repeat to compare clusters (default local)")
    p.add_argument("--gpus", type=int, required=True, help="number of devices")
    p.add_argument("--fix", default="", help="pin knobs with the --plan grammar plus mbs= and zero=")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_plan)

    s = subparsers.add_parser("simulate", help="timeline of one step per rank: Chrome trace + PNG")
    _common(s)
    s.add_argument("--cluster", default="local")
    s.add_argument("--plan", required=True, help="layout (--plan grammar plus mbs=, zero=); the rest is searched")
    s.add_argument("--out", default="simulation", help="output directory for trace.json and timeline.png")
    s.set_defaults(func=run_simulate)

    c = subparsers.add_parser("calibrate", help="measure this machine and write a cluster file")
    c.add_argument("--out", default=None, help="cluster file to write (default: the one --cluster local reads)")
    c.add_argument("--max-procs", type=int, default=4, help="largest collective group size to measure")
    c.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    c.add_argument("--quick", action="store_true", help="fewer sizes and repeats (for tests)")
    c.set_defaults(func=run_calibrate)


def options_for(args, cluster) -> Options:
    """The implementation a plan is for: the phalanx trainer (its precision and memory,
    `trainer_options`), or with --any-runtime the published runs' (Megatron-style)."""
    if args.any_runtime:
        if args.dtype:
            raise UserError("--dtype sets the phalanx trainer's precision; --any-runtime plans other "
                            "implementations' mixed precision (bf16 weights, fp32 master copy and moments)")
        if args.expert_slots:
            raise UserError("--expert-slots plans the phalanx trainer's expert slots; --any-runtime plans other "
                            "implementations, which have none")
        return Options(tp_overlap=args.tp_overlap, sp_regather=args.sp_regather, tp_splits_experts=True)
    if args.expert_slots < 0:
        raise UserError(f"--expert-slots={args.expert_slots} must not be negative (0: one slot per expert)")
    dtype = args.dtype or ("fp32" if cluster.shared_compute else "bf16")
    return trainer_options(dtype, cluster, tp_overlap=args.tp_overlap, sp_regather=args.sp_regather,
                           expert_slots=args.expert_slots)


def run_plan(args) -> int:
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
    space = SearchSpace(zero_levels=args.zero_levels, phalanx_trainer=not args.any_runtime)
    results = []
    for cluster in clusters:
        result = search(model, cluster, workload, world_size=args.gpus, fixed=fixed, space=space,
                        options=options_for(args, cluster), keep=args.top)
        if not result.ranked and result.considered == 0:
            raise UserError(_why_empty(args, fixed, fix_problems(model, workload, args.gpus, fixed, space,
                                                                 expert_slots=args.expert_slots)))
        results.append((cluster, result))
    if args.json:
        out = [{"cluster": c.name, "considered": r.considered, "pruned_memory": r.pruned_memory,
                "search_seconds": r.seconds, "plans": [plan_record(e, step_time_band(c)) for e in r.ranked]} for c, r in results]
        print(json.dumps(out[0] if len(out) == 1 else {"clusters": out}, indent=2))
        return 0 if all(r.ranked for _, r in results) else 1
    if len(results) > 1:
        _print_side_by_side(model.name, args, results)
    else:
        cluster, result = results[0]
        print(f"{model.name} on {args.gpus} x {cluster.name}, global batch {args.global_batch} x {args.seq_len} tokens")
        if result.ranked:
            print(format_table(COLUMNS, table_rows(result.ranked, step_time_band(cluster))))
            print()
            print("\n".join(explain(result, cluster.memory_gib - cluster.memory_reserved_gib)))
            print(f"best plan: --plan {result.ranked[0].layout.plan.to_string()}"
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


def _print_side_by_side(model_name: str, args, results) -> None:
    print(f"best plan for {model_name} on {args.gpus} GPUs, global batch {args.global_batch} x {args.seq_len}")
    names = [c.name for c, _ in results]
    fields = ["dp", "tp", "pp", "ep", "mbs", "microbatches", "schedule", "virtual", "recompute", "zero",
              "step_time_s", "step_time_band", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_gib_per_gpu"]
    rows = []
    records = [plan_record(r.ranked[0], step_time_band(c)) if r.ranked else None for c, r in results]
    for f in fields:
        row = [f]
        for rec in records:
            v = rec[f] if rec else "no fit"
            row.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        rows.append(row)
    for key in records[0]["breakdown"] if records[0] else []:
        rows.append([f"  {key} s"] + [f"{rec['breakdown'][key]:.3g}" if rec else "-" for rec in records])
    rows.append(["pruned for memory"] + [str(r.pruned_memory) for _, r in results])
    print(format_table(["", *names], rows))


def run_simulate(args) -> int:
    from phalanx.planner.simulate import simulate_command

    return simulate_command(args)


def run_calibrate(args) -> int:
    from phalanx.calibrate.command import calibrate_command

    return calibrate_command(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phalanx.planner.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
