"""A pipeline over the groups of a mixed cluster (`pp=P,dp=D[,tp=T],split=a:b:...`, 1f1b):
each group holds whole stages (its devices a multiple of D x T), in the file's order. A stage's
time per micro-batch is its layers' FLOPs times its group's seconds per FLOP, measured on the
homogeneous model (the balanced most-loaded stage's time over its FLOPs), and the layers are cut
by `adapt_policy.weighted_layer_counts`, the same cut the trainer's re-split makes from measured
times. Step = (m + P - 1) x the slowest stage, plus the most of each stage's own dp, optimizer
and pipeline-send time from its group's model (dp and optimizer scaled by its layer count;
sends, the share of boundaries inside one group), plus the sends that cross a group boundary
at the between-groups link. Energy: each stage a `Part` (mixed_energy.py) with its own
busy seconds and its group's power. Memory: the group's
balanced stage scaled by layers over the balanced count (the non-layer parts too, so an
overestimate for the stages that gain layers)."""

from __future__ import annotations

from typing import Callable

from phalanx import layout_rules as rules
from phalanx.adapt_policy import stage_costs, weighted_layer_counts
from phalanx.layout_rules import divisors
from phalanx.model.config import ModelConfig
from phalanx.plan import Plan
from phalanx.planner import comm
from phalanx.planner.cost import evaluate, layer_flops, problems
from phalanx.planner.energy import busy_seconds
from phalanx.planner.hardware import Cluster
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.memory import layers_per_stage
from phalanx.planner.mixed_cluster import MixedCluster
from phalanx.planner.mixed_energy import energy_detail
from phalanx.planner.mixed_plan import MAX_MBS, MixedPlan, Part, mixed_link_cluster
from phalanx.planner.options import Options, activation_bytes


def unit_costs(model: ModelConfig, seq: int) -> list[float]:
    """FLOPs of [embedding, layers..., output] for one sequence, forward and backward (the
    planner's counting, `cost.layer_flops`; causal attention halved). The embedding's are
    nearly none: it goes with the first stage."""
    costs = [0.0]
    for i in range(model.n_layers):
        gemm, attention = layer_flops(model, seq=seq, moe=model.is_moe_layer(i))
        costs.append(3 * (gemm + attention / 2))
    costs.append(3 * 2.0 * seq * model.dim * model.vocab_size)
    return costs


def stage_groups(mixed: MixedCluster, per_stage: int) -> list[int] | None:
    """Which group holds each stage (each group whole stages of `per_stage` devices)."""
    if any(g.devices % per_stage for g in mixed.groups):
        return None
    return [i for i, g in enumerate(mixed.groups) for _ in range(g.devices // per_stage)]


def pipeline_plans(model: ModelConfig, mixed: MixedCluster, seq: int, global_batch: int,
                   options_for: Callable[[Cluster], Options], *, zero_levels: tuple[int, ...] = (0, 2, 3),
                   keep: int = 10) -> list[MixedPlan]:
    world, n_layers = mixed.devices, model.n_layers
    costs = unit_costs(model, seq)
    mean_layer = sum(costs[1:-1]) / n_layers
    fast = min(g.cluster.fast_domain for g in mixed.groups)
    out = []
    for tp in divisors(fast):
        if rules.tp_problem(tp, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, ffn_dim=model.ffn_dim,
                            vocab_size=model.vocab_size, expert_ffn_dim=model.moe_ffn_dim, n_experts=model.n_experts):
            continue
        sp = tp > 1 and not model.n_experts and seq % tp == 0
        for dp in divisors(world // tp):
            stage_group = stage_groups(mixed, dp * tp)
            if stage_group is None or len(set(stage_group)) < 2 or len(stage_group) > n_layers:
                continue  # one group alone is the homogeneous planner's case
            p = len(stage_group)
            if global_batch % dp:
                continue
            for m in divisors(global_batch // dp):
                mbs = global_batch // dp // m
                if m < p or mbs > MAX_MBS:
                    continue
                for zero in zero_levels:
                    for recompute in ("none", "full"):
                        plan = Plan(dp=dp, tp=tp, pp=p, sp=sp, microbatches=m, zero=zero, recompute=recompute,
                                    schedule="1f1b")
                        if priced := price_pipeline(model, mixed, seq, global_batch, plan, mbs, stage_group, costs,
                                                     mean_layer, options_for):
                            out.append(priced)
    out.sort(key=lambda e: e.step_time_s)
    return out[:keep]


def price_pipeline(model, mixed, seq, global_batch, plan, mbs, stage_group, costs, mean_layer,
                    options_for, *, given: bool = False) -> MixedPlan | None:
    """The pipeline `plan` over the groups (`stage_group`: each stage's), with the split the
    group speeds give, or the plan's own `split=` when `given`; None if it does not run or fit."""
    p, m = plan.pp, plan.microbatches
    layout = Layout(plan, mbs=mbs)
    workload = Workload(global_batch=global_batch, seq_len=seq)
    if problems(model, workload, mixed.groups[0].cluster, layout, plan.world_size):
        return None
    ests = [evaluate(model, g.cluster, workload, layout, options_for(g.cluster)) for g in mixed.groups]
    n_bal = layers_per_stage(model.n_layers, p, 1)
    loaded = (n_bal * mean_layer + costs[-1]) * mbs  # the homogeneous model's most loaded stage
    scale = [(e.stage.f + e.stage.b + e.stage.w + e.stage.r) / loaded for e in ests]  # s per FLOP, per group
    stage_scale = [scale[g] for g in stage_group]
    counts = [int(x) for x in plan.split.split(":")] if given and plan.split else weighted_layer_counts(costs, stage_scale)
    even = weighted_layer_counts(costs, [1.0] * p)

    # Each group's pp_comm counts the sends of all p - 1 boundaries on its own links (2 per
    # micro-batch and boundary on the critical path, plus fill and drain). Of them, the share
    # inside one group is kept at the group's links; the share that crosses groups is priced
    # once, at the between-groups link (cross_s), not at both.
    crossings = sum(1 for a, b in zip(stage_group, stage_group[1:]) if a != b)
    inside = (p - 1 - crossings) / max(p - 1, 1)

    def step(split: list[int]) -> tuple[float, list[float]]:
        per_mb = [c * mbs * k for c, k in zip(stage_costs(costs, split), stage_scale)]
        rest = []
        for s, g in enumerate(stage_group):
            b = ests[g].breakdown
            rest.append(b["pp_comm"] * inside + (b["dp_comm"] + b["optimizer"]) * split[s] / n_bal + b["overhead"])
        return (m + p - 1) * max(per_mb) + max(rest), per_mb

    link = mixed_link_cluster(mixed, mixed.groups[0].cluster)
    partitioned = plan.sp or options_for(mixed.groups[0].cluster).pp_partitioned_sends
    boundary = mbs * seq * model.dim * activation_bytes(options_for(mixed.groups[0].cluster)) / (plan.tp if partitioned else 1)
    cross_s = 2 * (m + p - 1) * comm.send(link, boundary, same_domain=False) * crossings / max(p - 1, 1)
    time, per_mb = step(counts)
    base, _ = step(even)
    memory = []
    for g, est in enumerate(ests):
        most = max(c for c, sg in zip(counts, stage_group) if sg == g)
        memory.append(est.memory_bytes * max(1.0, most / n_bal))
    if any(mem > g.cluster.usable_bytes for mem, g in zip(memory, mixed.groups)) and not given:
        return None
    # Each stage as a Part (mixed_energy.py): its per micro-batch time, of which its group's
    # computing share (the balanced stage's compute and recompute over its time: exposed tp
    # collectives wait) is busy, m times, plus its optimizer step scaled by its layers. Stages
    # lighter than the slowest wait each micro-batch, so they can compute at lower clocks at no
    # cost in step time (Perseus's case, clocks.py); the energy that saves is in the detail.
    computing = [(busy_seconds(e) - e.breakdown["optimizer"]) / (m * (e.stage.f + e.stage.b + e.stage.w + e.stage.r))
                 for e in ests]
    parts = [Part(group=g, devices=plan.dp * plan.tp,
                  busy_s=m * t * computing[g] + ests[g].breakdown["optimizer"] * c / n_bal,
                  pace_s=t, clockable_s=m * t * computing[g])
             for t, g, c in zip(per_mb, stage_group, counts)]
    step_s = time + cross_s
    return MixedPlan(kind="pipeline", plan=plan.replace(split=":".join(map(str, counts))), mbs=mbs,
                     step_time_s=step_s, baseline_s=base + cross_s, memory_gib=tuple(x / 2**30 for x in memory),
                     detail={"stage_groups": stage_group, "even_split": ":".join(map(str, even)),
                             "stage_ms_per_microbatch": [t * 1e3 for t in per_mb],
                             "seconds_per_tflop_by_group": [k * 1e12 for k in scale],
                             "cross_group_send_s": cross_s,
                             **energy_detail(mixed, "pipeline", parts, step_s, microbatches=m,
                                             tokens=global_batch * seq)},
                     parts=tuple(parts))
