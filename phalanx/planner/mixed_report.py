"""`phalanx plan` and `phalanx simulate` on a mixed cluster file (`mixed_cluster.py`): the table,
the explanation of the choice and the `phalanx train` command that runs it."""

from __future__ import annotations

import json

from phalanx.errors import UserError
from phalanx.plan import parse_plan
from phalanx.planner.mixed_cluster import MixedCluster, load_mixed_cluster
from phalanx.planner.mixed_plan import MixedPlan
from phalanx.planner.mixed_search import evaluate_mixed_plan, mixed_search
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.plan_flags import options_for
from phalanx.planner.report import format_table


def _record(p: MixedPlan, tokens: int) -> dict:
    return {"kind": p.kind, "plan": p.plan.to_string(), "mbs": p.mbs, "step_time_s": p.step_time_s,
            "baseline_step_time_s": p.baseline_s, "tokens_per_s": tokens / p.step_time_s,
            "memory_gib_by_group": [round(x, 2) for x in p.memory_gib], **p.detail}


def train_command(args, mixed: MixedCluster, p: MixedPlan) -> list[str]:
    """The `phalanx train` command of the plan, and a line for what it cannot say."""
    per_node = {g.cluster.devices_per_node for g in mixed.groups}
    nodes = sum(g.nodes for g in mixed.groups)
    line = (f"phalanx train --model {args.model} --global-batch {args.global_batch} --seq-len {args.seq_len} "
            f"--nnodes {nodes} --nproc {max(per_node)} --rdzv-endpoint HOST:PORT --plan {p.plan.to_string()}")
    flags = f"--model {args.model} --global-batch {args.global_batch} --seq-len {args.seq_len} --plan {p.plan.to_string()}"
    first = " + ".join(f"{g.nodes} {g.name}" for g in mixed.groups)
    notes = [f"  {line}",
             "  phalanx train's rendezvous numbers nodes as they join; the plan's "
             + ("shares" if p.kind == "dp" else "stages") + " are given group by group in the file's order, so to "
             f"pin that order start node r (r = 0 .. {nodes - 1}: {first}) with torchrun's static node rank:",
             f"  torchrun --nnodes {nodes} --nproc-per-node {max(per_node)} --node-rank r --master-addr HOST "
             f"--master-port PORT -m phalanx train {flags}",
             "  (out of order, the run's adaptation, on unless --no-adapt, moves the "
             + ("shares to the measured speeds)" if p.kind == "dp" else "layers to the stages' measured times)")]
    if len(per_node) > 1:
        notes.append("  not expressible yet: the groups have different devices per node, and --nproc is one "
                     "count for every node")
    return notes


def best_line(mixed: MixedCluster, p: MixedPlan) -> str:
    """A pipeline's stages: where each runs, its layers and time per micro-batch."""
    d = p.detail
    groups = ", ".join(f"stage {s}: {mixed.groups[g].name}" for s, g in enumerate(d["stage_groups"]))
    return (f"{groups}; layers {p.plan.split}, per micro-batch "
            f"{', '.join(f'{t:.4g}' for t in d['stage_ms_per_microbatch'])} ms by stage, "
            f"seconds per PFLOP by group {', '.join(f'{k * 1e3:.4g}' for k in d['seconds_per_tflop_by_group'])}")


def explain(mixed: MixedCluster, best: MixedPlan) -> list[str]:
    d = best.detail
    lines = [f"why: {best.kind} layout, {best.step_time_s:.4g} s per step against {best.baseline_s:.4g} s "
             f"with {'equal shares' if best.kind == 'dp' else 'the even split'} ({best.gain:.2f}x)."]
    if best.kind == "dp":
        speeds = ", ".join(f"{g.name} {s:g}" for g, s in zip(mixed.groups, d["speeds_seq_per_s"]))
        shares = ", ".join(f"{g.name} {'/'.join(map(str, s))}" for g, s in zip(mixed.groups, d["shares_by_group"]))
        priced = ", ".join(f"{k} {v:.4g} s" for k, v in d["priced_s"].items())
        lines.append(f"  speed per device at the equal share (sequences/s): {speeds}")
        lines.append(f"  sequences per device: {shares} ({d['chosen']} shares; priced: {priced}); "
                     f"the gradient all-reduce over every group {d['dp_comm_s']:.3g} s at the slowest link")
        if any(r < 1 for r in d["clock_fraction_by_group"]):
            saved = d["clock_energy_saved_j_per_step"]
            lines.append("  ranks that finish their share early can compute at lower clocks at no cost in step time "
                         "(planner/clocks.py): clock fraction by group "
                         + ", ".join(f"{g.name} {r:.2f}" for g, r in zip(mixed.groups, d["clock_fraction_by_group"]))
                         + (f", {saved:.4g} J saved per step" if saved is not None else ""))
    else:
        lines.append(f"  {best_line(mixed, best)} (even split {d['even_split']})")
        if any(r < 1 for r in d["stage_clock_fraction"]):
            saved = d["clock_energy_saved_j_per_step"]
            lines.append("  stages lighter than the slowest can compute at lower clocks at no cost in step time "
                         "(planner/clocks.py): clock fraction by stage "
                         + ", ".join(f"{r:.2f}" for r in d["stage_clock_fraction"])
                         + (f", {saved:.4g} J saved per step" if saved is not None else ""))
    return lines


def run_mixed_plan(args, path: str) -> int:
    model = model_from_name(args.model)
    mixed = load_mixed_cluster(path)
    if args.gpus != mixed.devices:
        raise UserError(f"--gpus {args.gpus}: the mixed cluster {mixed.name!r} has {mixed.devices} devices "
                        f"({mixed.describe()}); plan for all of them")
    if args.fix or args.objective != "time" or args.price or args.expert_slots or args.any_runtime:
        raise UserError("a mixed cluster file takes none of --fix, --objective, --price, --expert-slots, "
                        "--any-runtime yet (docs/planner.md, Mixed clusters)")
    plans = mixed_search(model, mixed, args.seq_len, args.global_batch, lambda c: options_for(args, c),
                         zero_levels=args.zero_levels, keep=args.top)
    tokens = args.global_batch * args.seq_len
    if args.json:
        print(json.dumps({"cluster": mixed.name, "groups": [{"name": g.name, "preset": g.cluster.name, "nodes": g.nodes,
                                                              "devices": g.devices} for g in mixed.groups],
                          "plans": [_record(p, tokens) for p in plans]}, indent=2))
        return 0 if plans else 1
    print(f"{model.name} on {mixed.name}: {mixed.describe()}, global batch {args.global_batch} x {args.seq_len} tokens")
    if not plans:
        print("no mixed layout fits: plain dp needs the whole model on every device, a pipeline needs every "
              "group to hold whole stages of the same dp x tp", flush=True)
        return 1
    rows = [[p.kind, p.plan.to_string(), str(p.mbs), f"{p.step_time_s:.4g}", f"{p.gain:.2f}x",
             f"{tokens / p.step_time_s:,.0f}", " / ".join(f"{x:.1f}" for x in p.memory_gib)] for p in plans]
    print(format_table(["kind", "plan", "mbs", "step s", "vs even", "tokens/s", "GiB by group"], rows))
    print()
    print("\n".join(explain(mixed, plans[0])))
    print("run it with:")
    print("\n".join(train_command(args, mixed, plans[0])))
    return 0


def run_mixed_simulate(args, path: str) -> int:
    model = model_from_name(args.model)
    mixed = load_mixed_cluster(path)
    plan, _ = parse_plan(args.plan)
    p = evaluate_mixed_plan(model, mixed, args.seq_len, args.global_batch, plan.validate(),
                            lambda c: options_for(args, c))
    print(f"layout: {p.plan.to_string()} on {mixed.name}: {mixed.describe()}")
    tokens = args.global_batch * args.seq_len
    print(f"cost model step {p.step_time_s:.4g} s ({tokens / p.step_time_s:,.0f} tokens/s); "
          f"GiB by group {' / '.join(f'{x:.1f}' for x in p.memory_gib)}")
    d = p.detail
    if p.kind == "dp":
        print(f"slowest rank {d['slowest_rank']} (group {mixed.groups[d['group_of_slowest']].name}), gradient "
              f"all-reduce over every group {d['dp_comm_s']:.3g} s at the slowest link")
    else:
        print(f"the plan's split {p.plan.split or '(none: the planner cut it)'}: {best_line(mixed, p)}; "
              f"with the even split {d['even_split']}: {p.baseline_s:.4g} s")
        if any(x > g.cluster.memory_gib - g.cluster.memory_reserved_gib for x, g in zip(p.memory_gib, mixed.groups)):
            print("does not fit: a stage needs more memory than its group's devices have")
    print("no timeline is drawn for a mixed cluster yet (trace.json and timeline.png are the homogeneous simulator's)")
    return 0
