"""Each group of a mixed cluster alone, beside the plans over every group, when `phalanx plan`
on a mixed file ranks by energy or cost: the homogeneous planner's best layouts on that group's
devices (search.py), the other groups left out. A group left out is not held, so neither paid
for nor powered (mixed_energy.py): where another group's price or power per token is higher,
the cheapest or least energy plan does without it. Ranked by time, every plan uses every
device, as `--gpus` (the file's device count) asks and `phalanx train --plan auto` runs."""

from __future__ import annotations

from typing import Callable

from phalanx.model.config import ModelConfig
from phalanx.planner.energy import busy_seconds, objective_for
from phalanx.planner.hardware import Cluster
from phalanx.planner.layout import Workload
from phalanx.planner.mixed_cluster import MixedCluster
from phalanx.planner.mixed_energy import energy_detail
from phalanx.planner.mixed_plan import MixedPlan, Part
from phalanx.planner.options import Options
from phalanx.planner.search import SearchSpace, search


def alone_plans(model: ModelConfig, mixed: MixedCluster, seq: int, global_batch: int,
                options_for: Callable[[Cluster], Options], *, zero_levels: tuple[int, ...] = (0, 2, 3),
                keep: int = 10, by_energy: bool = False) -> list[MixedPlan]:
    """Per group, its `keep` fastest layouts (and its `keep` least energy ones with `by_energy`),
    each as a MixedPlan of kind "alone" whose one Part is every device of the group: energy.py's
    homogeneous count, the same number `energy.energy_per_step_j` gives."""
    workload = Workload(global_batch=global_batch, seq_len=seq)
    space = SearchSpace(zero_levels=zero_levels)
    out = []
    for g, group in enumerate(mixed.groups):
        if any(o.cluster == group.cluster and o.devices == group.devices for o in mixed.groups[:g]):
            continue  # the same machines in the same number as an earlier group: the same plans
        kinds = ["time", "energy"] if by_energy and group.cluster.busy_w > 0 else ["time"]
        seen = set()
        for kind in kinds:
            result = search(model, group.cluster, workload, world_size=group.devices, space=space,
                            options=options_for(group.cluster), keep=keep,
                            objective=objective_for(kind, None, group.cluster, {}))
            for est in result.ranked:
                if est.layout in seen:
                    continue
                seen.add(est.layout)
                busy = busy_seconds(est)
                parts = [Part(group=g, devices=est.world_size, busy_s=busy, pace_s=est.step_time_s, clockable_s=busy)]
                out.append(MixedPlan(
                    kind="alone", plan=est.layout.plan, mbs=est.layout.mbs, step_time_s=est.step_time_s,
                    baseline_s=est.step_time_s,
                    memory_gib=tuple(est.memory_gib if i == g else None for i in range(len(mixed.groups))),
                    detail={"group": group.name, "fix": est.layout.to_string(),
                            **energy_detail(mixed, "alone", parts, est.step_time_s, microbatches=est.layout.microbatches,
                                            tokens=est.tokens)},
                    parts=tuple(parts)))
    return out
