"""Uneven data parallelism over a mixed cluster (`dp=N,shares=a:b:...`, plain DDP over every
device): a rank of group g holding n sequences takes t_g(n), the homogeneous model's step on g
less its gradient all-reduce (`cost.evaluate`, dp=N, n sequences in `microbatches` micro-batches,
priced at the largest). The all-reduce spans the groups, so it is priced once, on the slowest
rank's group with the links replaced by the slowest between or within groups (a ring runs at
its slowest link). The step is the slowest rank's t_g(share) plus it. Three share vectors are
priced: equal (what a homogeneous plan gives), in proportion to speed
(`adapt_policy.proportional_shares`, what the trainer's adaptation converges to, speeds from t_g
at the equal share) and the exact min-max (the least T at which the ranks, each taking the most
sequences it runs within T, hold the global batch); the fastest wins. Energy: each rank a
`Part` (mixed_energy.py), busy for its own share's compute, idle while it waits."""

from __future__ import annotations

import math
from typing import Callable

from phalanx.adapt_policy import equal_shares, proportional_shares
from phalanx.layout_rules import divisors
from phalanx.model.config import ModelConfig
from phalanx.plan import Plan, parse_shares
from phalanx.planner.cost import Estimate, evaluate
from phalanx.planner.energy import busy_seconds
from phalanx.planner.hardware import Cluster
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.mixed_cluster import MixedCluster
from phalanx.planner.mixed_energy import energy_detail
from phalanx.planner.mixed_plan import MAX_MBS, MixedPlan, Part, mixed_link_cluster
from phalanx.planner.options import Options


def _dp_estimate(model: ModelConfig, cluster: Cluster, seq: int, world: int, n: int, m: int,
                 options: Options, tp: int = 1) -> Estimate:
    """Plain DDP over `world` ranks (dp ranks of `tp` devices each), each with `n` sequences in
    `m` micro-batches (priced at the largest micro-batch, ceil(n / m): the trainer cuts a share
    into parts one apart)."""
    mbs = math.ceil(n / m)
    return evaluate(model, cluster, Workload(global_batch=world * m * mbs, seq_len=seq),
                    Layout(Plan(dp=world, tp=tp, microbatches=m), mbs=mbs), options)


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
        parts = rank_parts([ests[group_of[r]][shares[r]] for r in range(world)],
                           [times[group_of[r]][shares[r]] for r in range(world)], group_of)
        memory = tuple(max(ests[group_of[r]][shares[r]].memory_bytes for r in range(world) if group_of[r] == g) / 2**30
                       for g in range(len(counts)))
        per_group = [sorted({shares[r] for r in range(world) if group_of[r] == g}) for g in range(len(counts))]
        out.append(MixedPlan(kind="dp", plan=plan, mbs=math.ceil(max(shares) / m), step_time_s=step,
                             baseline_s=priced["equal"][0], memory_gib=memory,
                             detail={"shares_by_group": per_group, "chosen": name, "dp_comm_s": dp_comm,
                                     "speeds_seq_per_s": [round(per_rank / times[g][per_rank], 4) for g in range(len(counts))],
                                     "priced_s": {k: v[0] for k, v in priced.items()},
                                     **energy_detail(mixed, "dp", parts, step, microbatches=m,
                                                     tokens=global_batch * seq)},
                             parts=tuple(parts)))
    return out


def rank_parts(ests: list[Estimate], times: list[float], group_of: list[int], tp: int = 1) -> list[Part]:
    """Each dp rank as a Part (mixed_energy.py): its tp devices compute its share's busy seconds
    (energy.busy_seconds of its group's model) within `times[r]`, its time before the all-reduce.
    Perseus's case for uneven dp (clocks.py): a rank that finishes its share before the slowest
    waits in the gradient all-reduce, so all of its computing can run at a lower clock."""
    return [Part(group=g, devices=tp, busy_s=busy_seconds(e), pace_s=t, clockable_s=busy_seconds(e))
            for e, t, g in zip(ests, times, group_of)]


def priced_shares(model, mixed, seq, global_batch, plan, options_for) -> MixedPlan:
    """`dp=N[,tp=T],shares=...` as given: dp rank r on devices r*T .. r*T+T-1 (tp innermost, every
    group holding whole dp ranks); the slowest rank's step plus the all-reduce over all of them.
    `phalanx simulate` and the published validation price tp > 1 so; the trainer's uneven shares
    run replicated dp only (tp=1), the layouts the search offers."""
    m, tp = plan.num_microbatches, plan.tp
    shares = parse_shares(plan.shares, plan.dp, global_batch, m)
    group_of = [g for g, grp in enumerate(mixed.groups) for _ in range(grp.devices // tp)]
    ests = [_dp_estimate(model, mixed.groups[group_of[r]].cluster, seq, plan.dp, shares[r], m,
                         options_for(mixed.groups[group_of[r]].cluster), tp) for r in range(plan.dp)]
    times = [e.step_time_s - e.breakdown["dp_comm"] for e in ests]
    slowest = max(range(plan.dp), key=lambda r: times[r])
    g = group_of[slowest]
    link = mixed_link_cluster(mixed, mixed.groups[g].cluster)
    dp_comm = _dp_estimate(model, link, seq, plan.dp, shares[slowest], m, options_for(mixed.groups[g].cluster),
                           tp).breakdown["dp_comm"]
    memory = tuple(max(ests[r].memory_bytes for r in range(plan.dp) if group_of[r] == i) / 2**30
                   for i in range(len(mixed.groups)))
    step = times[slowest] + dp_comm
    parts = rank_parts(ests, times, group_of, tp)
    return MixedPlan(kind="dp", plan=plan, mbs=math.ceil(max(shares) / m), step_time_s=step,
                     baseline_s=math.nan, memory_gib=memory,
                     detail={"chosen": "given", "dp_comm_s": dp_comm, "slowest_rank": slowest, "group_of_slowest": g,
                             **energy_detail(mixed, "dp", parts, step, microbatches=m, tokens=global_batch * seq)},
                     parts=tuple(parts))
