"""Plans over a mixed cluster (`mixed_cluster.py`): uneven data-parallel shares
(`mixed_dp.py`) and pipeline stages split unevenly over device groups (`mixed_pipeline.py`),
each priced with the homogeneous cost model of its group; both are layouts `phalanx train`
runs (docs/planner.md, Mixed clusters)."""

from __future__ import annotations

from typing import Callable

from phalanx.adapt_policy import equal_shares
from phalanx.errors import UserError
from phalanx.model.config import ModelConfig
from phalanx.plan import Plan, parse_split
from phalanx.planner.hardware import Cluster
from phalanx.planner.mixed_cluster import MixedCluster, load_mixed_cluster
from phalanx.planner.mixed_dp import dp_plans, priced_shares
from phalanx.planner.mixed_pipeline import pipeline_plans, price_pipeline, stage_groups, unit_costs
from phalanx.planner.mixed_plan import MixedPlan
from phalanx.planner.options import Options, trainer_options


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
    whole_ranks = all(g.devices % plan.tp == 0 for g in mixed.groups)
    if plan.pp == 1 and plan.cp == 1 and plan.zero == 0 and whole_ranks:
        if not plan.shares:  # equal shares, as a homogeneous plan gives them
            plan = plan.replace(shares=":".join(map(str, equal_shares(global_batch, plan.dp))))
        return priced_shares(model, mixed, seq, global_batch, plan, options_for)
    stage_group = stage_groups(mixed, plan.dp * plan.tp) if plan.pp > 1 and plan.cp == 1 and plan.virtual == 1 else None
    if stage_group is None or len(stage_group) != plan.pp or plan.shares:
        raise UserError(f"--plan {plan}: on a mixed cluster `phalanx simulate` prices plain data parallelism "
                        "(dp=N[,tp=T][,microbatches=M][,shares=a:b:...], each group holding whole dp ranks) or a pipeline "
                        "whose every group holds whole "
                        "stages of dp x tp devices (pp=P,dp=D[,tp=T][,split=...], one stage per pp rank)")
    if plan.split:
        parse_split(plan.split, plan.pp, model.n_layers)
    m = plan.num_microbatches
    if global_batch % (plan.dp * m):
        raise UserError(f"--plan {plan}: global batch {global_batch} does not split into dp={plan.dp} x "
                        f"microbatches={m} micro-batches")
    costs = unit_costs(model, seq)
    priced = price_pipeline(model, mixed, seq, global_batch, plan, global_batch // (plan.dp * m), stage_group, costs,
                             sum(costs[1:-1]) / model.n_layers, options_for, given=True)
    if priced is None:
        raise UserError(f"--plan {plan} is not a layout {model.name} runs at global batch {global_batch}")
    return priced


def mixed_auto_plan(model: ModelConfig, path: str, *, world_size: int, global_batch: int, seq_len: int,
                    dtype: str, expert_slots: int = 0) -> Plan:
    """`phalanx train --plan auto --cluster MIXED_FILE`: the fastest mixed layout, its shares or
    split included (the trainer starts from them and adapts)."""
    mixed = load_mixed_cluster(path)
    if world_size != mixed.devices:
        raise UserError(f"--plan auto for {path}: {world_size} processes, but the mixed cluster has {mixed.devices} "
                        f"devices ({mixed.describe()})")
    if expert_slots:
        raise UserError(f"--plan auto for the mixed cluster {path}: expert slots are not planned over groups yet")
    plans = mixed_search(model, mixed, seq_len, global_batch, lambda c: trainer_options(dtype, c), keep=1)
    if not plans:
        raise UserError(f"no layout of {model.name!r} over the mixed cluster {path} fits at global batch {global_batch}")
    return plans[0].plan
