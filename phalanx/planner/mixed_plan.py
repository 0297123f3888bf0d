"""What the mixed-cluster planner (`mixed_dp.py`, `mixed_pipeline.py`, `mixed_search.py`) gives
back for one layout, and the links a collective over every group runs at."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from phalanx.plan import Plan
from phalanx.planner.hardware import Cluster
from phalanx.planner.mixed_cluster import MixedCluster

MAX_MBS = 16
"""Most sequences per micro-batch searched, as the homogeneous search's `SearchSpace.max_mbs`."""


@dataclass(frozen=True)
class Part:
    """Devices of one group that compute alike in a plan's step: a dp rank (its tp devices), or a
    pipeline stage's dp x tp devices. A plan's energy is counted part by part (mixed_energy.py)."""
    group: int
    devices: int
    busy_s: float
    """Seconds of the step each of its devices computes at full clock (energy.BUSY_KEYS of its
    group's model: compute, recompute, optimizer); the rest of the step it waits, at idle power."""
    pace_s: float
    """What the slowest part sets the step by: a dp rank's time before the gradient all-reduce;
    a stage's time per micro-batch."""
    clockable_s: float
    """Of busy_s, the seconds a lower clock stretches into its slack: all of a dp rank's; a
    stage's micro-batches' (its optimizer step, after the last one, stays at full clock)."""


@dataclass(frozen=True)
class MixedPlan:
    """One priced layout over a mixed cluster."""
    kind: str
    """"dp" (uneven shares), "pipeline" (stages over groups) or "alone" (one group's homogeneous
    plan, the others left out: mixed_alone.py)."""
    plan: Plan
    mbs: int
    """Sequences per micro-batch (the largest, with uneven shares)."""
    step_time_s: float
    baseline_s: float
    """The same layout as a homogeneous planner would give it: equal shares, or the even split."""
    memory_gib: tuple[float | None, ...]
    """Per group, the most loaded device's (None for a group the plan leaves out)."""
    detail: dict = field(default_factory=dict)
    parts: tuple[Part, ...] = ()
    """What its energy is counted from (mixed_energy.py); not printed."""

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
