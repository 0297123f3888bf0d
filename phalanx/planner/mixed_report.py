"""`phalanx plan` and `phalanx simulate` on a mixed cluster file (`mixed_cluster.py`): the table
(with energy per token and, with `--price`, cost per million tokens: mixed_energy.py), the
plans ranked by `--objective` (and `--max-slowdown`), the explanation of the choice and the
`phalanx train` command that runs it."""

from __future__ import annotations

import json

from phalanx.errors import UserError
from phalanx.plan import parse_plan
from phalanx.planner.energy import parse_prices
from phalanx.planner.mixed_alone import alone_plans
from phalanx.planner.mixed_cluster import MixedCluster, load_mixed_cluster
from phalanx.planner.mixed_energy import (MixedObjective, check_mixed_prices, cost_usd_per_mtok, energy_j,
                                          mixed_objective)
from phalanx.planner.mixed_plan import MixedPlan
from phalanx.planner.mixed_search import evaluate_mixed_plan, mixed_search
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.plan_flags import options_for
from phalanx.planner.report import format_table


def _record(mixed: MixedCluster, p: MixedPlan, objective: MixedObjective) -> dict:
    """One plan as JSON (names as the homogeneous plan records' where they mean the same):
    `cost_usd_per_mtok` null without --price; `clocked_*` null unless ranked by energy under
    --max-slowdown (`clocked_fractions`: by part, dp ranks or stages)."""
    tokens = objective.tokens
    lowered = objective.clocked(mixed, p)
    return {"kind": p.kind, "plan": p.plan.to_string(), "mbs": p.mbs, "step_time_s": p.step_time_s,
            "baseline_step_time_s": p.baseline_s, "tokens_per_s": tokens / p.step_time_s,
            "memory_gib_by_group": [round(x, 2) if x is not None else None for x in p.memory_gib], **p.detail,
            "cost_usd_per_mtok": cost_usd_per_mtok(mixed, p, objective.prices, tokens) if objective.prices else None,
            "clocked_fractions": list(lowered.fractions) if lowered else None,
            "clocked_step_time_s": lowered.step_time_s if lowered else None,
            "clocked_energy_j_per_step": lowered.energy_j if lowered else None}


def train_command(args, mixed: MixedCluster, p: MixedPlan) -> list[str]:
    """The `phalanx train` command of the plan, and a line for what it cannot say."""
    if p.kind == "alone":
        group = next(g for g in mixed.groups if g.name == p.detail["group"])
        return [f"  phalanx train --model {args.model} --global-batch {args.global_batch} --seq-len {args.seq_len} "
                f"--nnodes {group.nodes} --nproc {group.cluster.devices_per_node} --rdzv-endpoint HOST:PORT "
                f"--plan {p.plan.to_string()}",
                f"  (on the {group.name} nodes only; the other groups are left out)"]
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
    if best.kind == "alone":
        return [f"why: {d['group']} alone, {best.step_time_s:.4g} s per step: the homogeneous planner's layout "
                f"{d['fix']} on its devices, the other groups left out (not held: neither paid for nor powered)"]
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


SEARCH_KEEP = 50
"""Pipelines kept from the search when ranking by energy or cost (the fastest first)."""


def explain_objective(mixed: MixedCluster, ranked: list[MixedPlan], fastest: MixedPlan | None,
                      objective: MixedObjective) -> list[str]:
    """Why #1 wins on energy or cost: its figure against the fastest plan's and each runner-up's,
    and what the difference is made of (energy: every device's idle power over a longer step, or
    busy power over more computing seconds; cost: the step alone, every plan holding every
    group's devices for it)."""
    best = ranked[0]
    unit = {"energy": "J/token", "cost": "$/Mtok", "time": "s"}[objective.kind]

    def per(p: MixedPlan) -> float:
        v = objective.value(mixed, p)
        return v / objective.tokens if objective.kind == "energy" else v

    bound = (f" among the plans within {objective.max_slowdown:g}x the fastest plan's step time"
             if objective.max_slowdown is not None else "")
    busy = ", ".join(f"{g.name} {b:.0%}" for g, b in zip(mixed.groups, best.detail["busy_fraction_by_group"])
                     if b is not None)
    lines = [f"ranked by {objective.kind}{bound}: #1 takes {per(best):.4g} {unit}, its devices busy "
             f"{busy} of its {best.step_time_s:.4g} s step"]
    if objective.kind == "cost":
        held = ", ".join(f"{g.devices} x {g.cluster.name} at ${objective.prices[g.cluster.name]:g}" for g in mixed.groups)
        lines.append(f"a plan over the groups holds every group's devices for its step ({held} per GPU hour), a "
                     "group alone only its own: among the plans over the groups the cheapest is the fastest")
    if (lowered := objective.clocked(mixed, best)) is not None:
        full = energy_j(mixed, best.parts, best.step_time_s)  # at full clock, as the homogeneous report
        lines.append(f"clocks lowered into the slack and the slowdown bound (planner/clocks.py, power as the clock "
                     f"cubed): #1's {'ranks' if best.kind == 'dp' else 'stages'} at "
                     f"{', '.join(f'{r:.0%}' for r in _distinct(lowered.fractions))} of their maximum clock, its step "
                     f"{lowered.step_time_s:.4g} s, {1 - lowered.energy_j / full:.1%} less energy than at full clock")
    if fastest is None or fastest is best:
        lines.append("#1 is also the fastest plan")
    else:
        gap = 1 - per(best) / per(fastest)
        where = f"{fastest.detail['group']} alone " if fastest.kind == "alone" else ""
        lines.append(f"the fastest plan, {where}{fastest.plan.to_string()}, takes {fastest.step_time_s:.4g} s "
                     f"({best.step_time_s / fastest.step_time_s - 1:+.1%} for #1) but {per(fastest):.4g} {unit}: "
                     f"#1 spends {gap:.1%} less{_why(mixed, best, fastest, objective)}")
    for rank, p in enumerate(ranked[1:], start=2):
        gap = per(p) - per(best)
        lines.append(f"#{rank} +{gap:.3g} {unit} ({gap / per(best):+.1%}){_why(mixed, best, p, objective, short=True)}")
    return lines


def _distinct(values) -> list[float]:
    return sorted({round(v, 4) for v in values}, reverse=True)


def _why(mixed: MixedCluster, best: MixedPlan, other: MixedPlan, objective: MixedObjective,
         short: bool = False) -> str:
    """Which part of `other`'s spend differs from `best`'s: every device's idle power over a
    longer step, or the rest, busy power above idle (more computing seconds, on the hungrier
    group, or at a higher clock); the steps and joules as ranked (clocked under a bound)."""
    def step_s(p: MixedPlan) -> float:
        lowered = objective.clocked(mixed, p)
        return lowered.step_time_s if lowered else p.step_time_s

    def idle_j(p: MixedPlan) -> float:  # the devices it holds at idle power over its step
        return sum(q.devices * mixed.groups[q.group].cluster.idle_w for q in p.parts) * step_s(p)

    def per_hour(p: MixedPlan) -> float:  # dollars an hour of the devices it holds
        return sum(q.devices * objective.prices[mixed.groups[q.group].cluster.name] for q in p.parts)

    d_step = step_s(other) - step_s(best)
    if objective.kind == "cost":
        held = f"${per_hour(other):g} an hour of devices against #1's ${per_hour(best):g}"
        if short:
            return f": its step is {d_step:+.3g} s" + (f", {held}" if per_hour(other) != per_hour(best) else "")
        return f"; the fastest plan holds {held}"
    if objective.kind != "energy":
        return f": its step is {d_step:+.3g} s" if short else ""
    idle_part = idle_j(other) - idle_j(best)
    busy_part = objective.value(mixed, other) - objective.value(mixed, best) - idle_part
    if abs(busy_part) >= abs(idle_part):
        what = f"{busy_part / 1e3:+.3g} kJ of computing above idle power (busy seconds, and where and at what clock)"
    else:
        what = (f"{idle_part / 1e3:+.3g} kJ of idle power (a {d_step:+.3g} s step, over the "
                f"{sum(q.devices for q in other.parts)} devices it holds)")
    return f": mostly {what}" if short else f"; the fastest plan's extra is mostly {what}"


def run_mixed_plan(args, path: str) -> int:
    model = model_from_name(args.model)
    mixed = load_mixed_cluster(path)
    if args.gpus != mixed.devices:
        raise UserError(f"--gpus {args.gpus}: the mixed cluster {mixed.name!r} has {mixed.devices} devices "
                        f"({mixed.describe()}); plan for all of them")
    if args.fix or args.expert_slots or args.any_runtime:
        raise UserError("a mixed cluster file takes none of --fix, --expert-slots, --any-runtime yet "
                        "(docs/planner.md, Mixed clusters)")
    tokens = args.global_batch * args.seq_len
    objective = mixed_objective(args.objective, args.max_slowdown, mixed, parse_prices(args.price), tokens)
    # Ranked by another objective than time, every priced layout is a candidate, not only the
    # fastest `--top` (mixed_search keeps the fastest pipelines only up to its `keep`).
    keep = args.top if objective.kind == "time" else max(args.top, SEARCH_KEEP)
    plans = mixed_search(model, mixed, args.seq_len, args.global_batch, lambda c: options_for(args, c),
                         zero_levels=args.zero_levels, keep=keep)
    if objective.kind != "time":  # what is cheapest or uses least may leave a group out (mixed_alone.py)
        plans += alone_plans(model, mixed, args.seq_len, args.global_batch, lambda c: options_for(args, c),
                             zero_levels=args.zero_levels, keep=keep, by_energy=objective.kind == "energy")
    plans.sort(key=lambda p: p.step_time_s)
    fastest = plans[0] if plans else None
    plans = objective.rank(mixed, plans)[:args.top]
    if args.json:
        print(json.dumps({"cluster": mixed.name, "groups": [{"name": g.name, "preset": g.cluster.name, "nodes": g.nodes,
                                                              "devices": g.devices} for g in mixed.groups],
                          "objective": args.objective, "max_slowdown": args.max_slowdown,
                          "plans": [_record(mixed, p, objective) for p in plans]}, indent=2))
        return 0 if plans else 1
    print(f"{model.name} on {mixed.name}: {mixed.describe()}, global batch {args.global_batch} x {args.seq_len} tokens")
    if not plans:
        print("no mixed layout fits: plain dp needs the whole model on every device, a pipeline needs every "
              "group to hold whole stages of the same dp x tp", flush=True)
        return 1
    rows = [[p.kind if p.kind != "alone" else f"{p.detail['group']} alone", p.plan.to_string(), str(p.mbs),
             f"{p.step_time_s:.4g}", f"{p.gain:.2f}x" if p.kind != "alone" else "-",
             f"{tokens / p.step_time_s:,.0f}", " / ".join(f"{x:.1f}" if x is not None else "-" for x in p.memory_gib),
             f"{p.detail['energy_j_per_token']:.4g}" if p.detail.get("energy_j_per_token") is not None else "-",
             *([f"{cost_usd_per_mtok(mixed, p, objective.prices, tokens):.4g}"] if objective.prices else [])]
            for p in plans]
    print(format_table(["kind", "plan", "mbs", "step s", "vs even", "tokens/s", "GiB by group", "J/token",
                        *(["$/Mtok"] if objective.prices else [])], rows))
    print()
    print("\n".join(explain(mixed, plans[0])))
    if objective.kind != "time" or objective.max_slowdown is not None:
        print("\n".join(explain_objective(mixed, plans, fastest, objective)))
    print("run it with:")
    print("\n".join(train_command(args, mixed, plans[0])))
    return 0


def run_mixed_simulate(args, path: str) -> int:
    model = model_from_name(args.model)
    mixed = load_mixed_cluster(path)
    plan, _ = parse_plan(args.plan)
    prices = parse_prices(args.price)
    check_mixed_prices(prices, mixed)
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
    if (energy := d["energy_j_per_step"]) is not None:  # of the cost model's step (mixed_energy.py)
        print(f"predicted energy {energy / 1e3:.4g} kJ per step, {energy / tokens:.4g} J/token, busy "
              + ", ".join(f"{g.name} {b:.0%}" for g, b in zip(mixed.groups, d["busy_fraction_by_group"]))
              + f" of the step; {d['clock_energy_saved_j_per_step'] / 1e3:.3g} kJ less with the slack's clocks lowered")
    if prices:
        print(f"predicted cost ${cost_usd_per_mtok(mixed, p, prices, tokens):.4g} per million tokens at "
              + ", ".join(f"${prices[g.cluster.name]:g} per {g.cluster.name} GPU hour" for g in mixed.groups))
    print("no timeline is drawn for a mixed cluster yet (trace.json and timeline.png are the homogeneous simulator's)")
    return 0
