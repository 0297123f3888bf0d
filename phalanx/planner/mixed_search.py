"""Plans over a mixed cluster (`mixed_cluster.py`): uneven data-parallel shares and pipeline
stages split unevenly over device groups, priced with the homogeneous cost model of each group.

Two kinds of layout, both ones `phalanx train` runs:

- **Uneven data parallelism** (`dp=N,shares=a:b:...`, plain DDP over all N devices): a rank
  of group g holding n sequences takes t_g(n), the homogeneous model's step on g less its
  gradient all-reduce (`cost.evaluate`, dp=N, n sequences per rank in `microbatches`
  micro-batches). The all-reduce spans the groups, so it is priced once, on the slowest group
  with the links replaced by the slowest between or within groups (a ring runs at its slowest
  link). The step is max over ranks of t_g(share) plus it. Three share vectors are priced:
  equal (what a homogeneous plan gives), in proportion to speed (`adapt_policy.
  proportional_shares`, what the trainer's adaptation converges to, speeds from t_g at the equal
  share) and the exact min-max (the least T such that the ranks whose t_g(n) <= T hold the
  global batch); the fastest wins.
- **Pipeline over groups** (`pp=P,dp=D[,tp=T],split=a:b:...`, 1f1b): each group holds whole
  stages (its devices a multiple of D x T), in the file's order. A stage's time per
  micro-batch is its layers' FLOPs times its group's seconds per FLOP, measured on the
  homogeneous model (the balanced most-loaded stage's time over its FLOPs), and the layers are
  cut by `adapt_policy.weighted_layer_counts`, the same cut the trainer's re-split makes from
  measured times. Step = (m + P - 1) x the slowest stage, plus each stage's own dp, optimizer
  and pipeline-send time from its group's model (dp and optimizer scaled by its layer count),
  plus the sends that cross a group boundary at the between-groups link. Memory: the group's
  balanced stage scaled by layers over the balanced count (the non-layer parts too, so an
  overestimate for the stages that gain layers).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from phalanx import layout_rules as rules
from phalanx.adapt_policy import equal_shares, proportional_shares, stage_costs, weighted_layer_counts
from phalanx.errors import UserError
from phalanx.layout_rules import divisors
from phalanx.model.config import ModelConfig
from phalanx.plan import Plan, parse_shares, parse_split
from phalanx.planner import comm
from phalanx.planner.cost import Estimate, evaluate, layer_flops, problems
from phalanx.planner.hardware import Cluster
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.memory import layers_per_stage
from phalanx.planner.mixed_cluster import MixedCluster
from phalanx.planner.options import Options

BF16 = 2
MAX_MBS = 16


@dataclass(frozen=True)
class MixedPlan:
    """One priced layout over a mixed cluster."""
    kind: str
    """"dp" (uneven shares) or "pipeline" (stages over groups)."""
    plan: Plan
    mbs: int
    """Sequences per micro-batch (the largest, with uneven shares)."""
    step_time_s: float
    baseline_s: float
    """The same layout as a homogeneous planner would give it: equal shares, or the even split."""
    memory_gib: tuple[float, ...]
    """Per group, the most loaded device's."""
    detail: dict = field(default_factory=dict)

    @property
    def gain(self) -> float:
        return self.baseline_s / self.step_time_s


def mixed_link_cluster(mixed: MixedCluster, base: Cluster) -> Cluster:
    """`base` with the links a collective over every group runs at: the slowest NIC or
    between-groups link, the highest latency, the smallest fast domain."""
    groups = [g.cluster for g in mixed.groups]
    return dataclasses.replace(
        base, inter_bw_gbs=min(mixed.between_bw_gbs, *(c.inter_bw_gbs for c in groups)),
        inter_latency_us=max(mixed.between_latency_us, *(c.inter_latency_us for c in groups)),
        fast_domain=min(c.fast_domain for c in groups), devices_per_node=min(c.devices_per_node for c in groups))


# ---- uneven data parallelism -------------------------------------------------------------

def _dp_estimate(model: ModelConfig, cluster: Cluster, seq: int, world: int, n: int, m: int,
                 options: Options) -> Estimate:
    """Plain DDP over `world` ranks, each with `n` sequences in `m` micro-batches (priced at
    the largest micro-batch, ceil(n / m): the trainer cuts a share into parts one apart)."""
    mbs = math.ceil(n / m)
    return evaluate(model, cluster, Workload(global_batch=world * m * mbs, seq_len=seq),
                    Layout(Plan(dp=world, microbatches=m), mbs=mbs), options)


def _minmax_shares(times: list[dict[int, float]], counts: list[int], total: int, m: int) -> list[int] | None:
    """Per-rank shares (group by group) that minimise the slowest rank's time: the least T at
    which the ranks, each taking the most sequences it runs within T, hold `total`; the excess
    then taken from the ranks slowest at their share."""
    for limit in sorted({t for group in times for t in group.values()}):
        caps = [max((n for n, t in group.items() if t <= limit), default=0) for group in times]
        if any(c < m for c in caps):
            continue
        if sum(c * k for c, k in zip(caps, counts)) < total:
            continue
        ranks = [(g, c) for g, (c, k) in enumerate(zip(caps, counts)) for _ in range(k)]
        shares = [c for _, c in ranks]
        excess = sum(shares) - total
        while excess:
            r = max((r for r in range(len(shares)) if shares[r] > m),
                    key=lambda r: (times[ranks[r][0]].get(shares[r], math.inf), r))
            shares[r] -= 1
            excess -= 1
        return shares
    return None


def dp_plans(model: ModelConfig, mixed: MixedCluster, seq: int, global_batch: int,
             options_for: Callable[[Cluster], Options]) -> list[MixedPlan]:
    world = mixed.devices
    if global_batch % world:
        return []  # the trainer needs the global batch to split evenly over the dp ranks to start
    counts = [g.devices for g in mixed.groups]
    per_rank = global_batch // world
    out = []
    for m in [d for d in divisors(per_rank) if d <= MAX_MBS]:
        top = [min(global_batch - m * (world - k), math.ceil(global_batch / k)) for k in counts]
        ests = [{n: _dp_estimate(model, g.cluster, seq, world, n, m, options_for(g.cluster))
                 for n in range(m, top_g + 1)} for g, top_g in zip(mixed.groups, top)]
        usable = [g.cluster.usable_bytes for g in mixed.groups]
        times = [{n: e.step_time_s - e.breakdown["dp_comm"] for n, e in group.items() if e.memory_bytes <= room}
                 for group, room in zip(ests, usable)]
        if any(per_rank not in group for group in times):
            continue  # even the equal share does not fit one group
        speeds = [per_rank / times[g][per_rank] for g, k in enumerate(counts) for _ in range(k)]
        group_of = [g for g, k in enumerate(counts) for _ in range(k)]
        candidates = {"equal": list(equal_shares(global_batch, world)),
                      "speed-proportional": list(proportional_shares(speeds, global_batch, minimum=m))}
        if (best := _minmax_shares(times, counts, global_batch, m)) is not None:
            candidates["min-max"] = best
        priced = {}
        for name, shares in candidates.items():
            if any(shares[r] not in times[group_of[r]] for r in range(world)):
                continue  # some rank's share does not fit its memory
            slowest = max(range(world), key=lambda r: times[group_of[r]][shares[r]])
            g, n = group_of[slowest], shares[slowest]
            link = mixed_link_cluster(mixed, mixed.groups[g].cluster)
            dp_comm = _dp_estimate(model, link, seq, world, n, m, options_for(mixed.groups[g].cluster)).breakdown["dp_comm"]
            priced[name] = (times[g][n] + dp_comm, shares, dp_comm)
        if "equal" not in priced:
            continue
        name = min(priced, key=lambda k: (priced[k][0], k != "speed-proportional"))
        step, shares, dp_comm = priced[name]
        plan = Plan(dp=world, microbatches=m, shares=":".join(map(str, shares)))
        memory = tuple(max(ests[group_of[r]][shares[r]].memory_bytes for r in range(world) if group_of[r] == g) / 2**30
                       for g in range(len(counts)))
        per_group = [sorted({shares[r] for r in range(world) if group_of[r] == g}) for g in range(len(counts))]
        out.append(MixedPlan(kind="dp", plan=plan, mbs=math.ceil(max(shares) / m), step_time_s=step,
                             baseline_s=priced["equal"][0], memory_gib=memory,
                             detail={"shares_by_group": per_group, "chosen": name, "dp_comm_s": dp_comm,
                                     "speeds_seq_per_s": [round(per_rank / times[g][per_rank], 4) for g in range(len(counts))],
                                     "priced_s": {k: v[0] for k, v in priced.items()}}))
    return out


# ---- pipelines over groups ---------------------------------------------------------------

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


def _stage_group(mixed: MixedCluster, per_stage: int) -> list[int] | None:
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
            stage_group = _stage_group(mixed, dp * tp)
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
                        if priced := _price_pipeline(model, mixed, seq, global_batch, plan, mbs, stage_group, costs,
                                                     mean_layer, options_for):
                            out.append(priced)
    out.sort(key=lambda e: e.step_time_s)
    return out[:keep]


def _price_pipeline(model, mixed, seq, global_batch, plan, mbs, stage_group, costs, mean_layer,
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

    def step(split: list[int]) -> tuple[float, list[float]]:
        per_mb = [c * mbs * k for c, k in zip(stage_costs(costs, split), stage_scale)]
        rest = []
        for s, g in enumerate(stage_group):
            b = ests[g].breakdown
            rest.append(b["pp_comm"] + (b["dp_comm"] + b["optimizer"]) * split[s] / n_bal + b["overhead"])
        return (m + p - 1) * max(per_mb) + max(rest), per_mb

    crossings = sum(1 for a, b in zip(stage_group, stage_group[1:]) if a != b)
    link = mixed_link_cluster(mixed, mixed.groups[0].cluster)
    boundary = mbs * seq * model.dim * BF16 / (plan.tp if plan.sp else 1)
    cross_s = 2 * (m + p - 1) * comm.send(link, boundary, same_domain=False) * crossings / max(p - 1, 1)
    time, per_mb = step(counts)
    base, _ = step(even)
    memory = []
    for g, est in enumerate(ests):
        most = max(c for c, sg in zip(counts, stage_group) if sg == g)
        memory.append(est.memory_bytes * max(1.0, most / n_bal))
    if any(mem > g.cluster.usable_bytes for mem, g in zip(memory, mixed.groups)) and not given:
        return None
    return MixedPlan(kind="pipeline", plan=plan.replace(split=":".join(map(str, counts))), mbs=mbs,
                     step_time_s=time + cross_s, baseline_s=base + cross_s, memory_gib=tuple(x / 2**30 for x in memory),
                     detail={"stage_groups": stage_group, "even_split": ":".join(map(str, even)),
                             "stage_ms_per_microbatch": [t * 1e3 for t in per_mb],
                             "seconds_per_tflop_by_group": [k * 1e12 for k in scale],
                             "cross_group_send_s": cross_s})


def mixed_search(model: ModelConfig, mixed: MixedCluster, seq: int, global_batch: int,
                 options_for: Callable[[Cluster], Options], *, zero_levels: tuple[int, ...] = (0, 2, 3),
                 keep: int = 10) -> list[MixedPlan]:
    """Every priced layout, fastest first."""
    plans = dp_plans(model, mixed, seq, global_batch, options_for)
    plans += pipeline_plans(model, mixed, seq, global_batch, options_for, zero_levels=zero_levels, keep=keep)
    plans.sort(key=lambda e: e.step_time_s)
    return plans[:keep]


def evaluate_mixed_plan(model: ModelConfig, mixed: MixedCluster, seq: int, global_batch: int, plan: Plan,
                        options_for: Callable[[Cluster], Options]) -> MixedPlan:
    """A given `--plan` on the mixed cluster (`phalanx simulate`): dp with `shares=` priced as
    given, a pipeline over groups with the plan's `split=` (the planner's when it has none)."""
    if plan.world_size != mixed.devices:
        raise UserError(f"--plan {plan} covers {plan.world_size} devices; the mixed cluster {mixed.name!r} has "
                        f"{mixed.devices} ({mixed.describe()})")
    if plan.pp == 1 and plan.tp == plan.cp == 1 and plan.zero == 0:
        if not plan.shares:  # equal shares, as a homogeneous plan gives them
            plan = plan.replace(shares=":".join(map(str, equal_shares(global_batch, plan.dp))))
        return _dp_given(model, mixed, seq, global_batch, plan, options_for)
    stage_group = _stage_group(mixed, plan.dp * plan.tp) if plan.pp > 1 and plan.cp == 1 and plan.virtual == 1 else None
    if stage_group is None or len(stage_group) != plan.pp or plan.shares:
        raise UserError(f"--plan {plan}: on a mixed cluster `phalanx simulate` prices plain data parallelism "
                        "(dp=N[,microbatches=M][,shares=a:b:...]) or a pipeline whose every group holds whole "
                        "stages of dp x tp devices (pp=P,dp=D[,tp=T][,split=...], one stage per pp rank)")
    if plan.split:
        parse_split(plan.split, plan.pp, model.n_layers)
    m = plan.num_microbatches
    if global_batch % (plan.dp * m):
        raise UserError(f"--plan {plan}: global batch {global_batch} does not split into dp={plan.dp} x "
                        f"microbatches={m} micro-batches")
    costs = unit_costs(model, seq)
    priced = _price_pipeline(model, mixed, seq, global_batch, plan, global_batch // (plan.dp * m), stage_group, costs,
                             sum(costs[1:-1]) / model.n_layers, options_for, given=True)
    if priced is None:
        raise UserError(f"--plan {plan} is not a layout {model.name} runs at global batch {global_batch}")
    return priced


def _dp_given(model, mixed, seq, global_batch, plan, options_for) -> MixedPlan:
    m = plan.num_microbatches
    shares = parse_shares(plan.shares, plan.dp, global_batch, m)
    group_of = [g for g, grp in enumerate(mixed.groups) for _ in range(grp.devices)]
    ests = [_dp_estimate(model, mixed.groups[group_of[r]].cluster, seq, plan.dp, shares[r], m,
                         options_for(mixed.groups[group_of[r]].cluster)) for r in range(plan.dp)]
    times = [e.step_time_s - e.breakdown["dp_comm"] for e in ests]
    slowest = max(range(plan.dp), key=lambda r: times[r])
    g = group_of[slowest]
    link = mixed_link_cluster(mixed, mixed.groups[g].cluster)
    dp_comm = _dp_estimate(model, link, seq, plan.dp, shares[slowest], m, options_for(mixed.groups[g].cluster)).breakdown["dp_comm"]
    memory = tuple(max(ests[r].memory_bytes for r in range(plan.dp) if group_of[r] == i) / 2**30
                   for i in range(len(mixed.groups)))
    return MixedPlan(kind="dp", plan=plan, mbs=math.ceil(max(shares) / m), step_time_s=times[slowest] + dp_comm,
                     baseline_s=math.nan, memory_gib=memory,
                     detail={"chosen": "given", "dp_comm_s": dp_comm, "slowest_rank": slowest, "group_of_slowest": g})
