"""Lower clocks where a device has slack: the energy a Perseus-style frequency plan saves
(`--max-slowdown F` with `--objective energy`; the mixed planner's uneven pipeline stages).

Perseus (Chung et al., SOSP'24, "Reducing Energy Bloat in Large Model Training") runs the
computations that are off the step's critical path at lower GPU clocks: a device that would
otherwise finish early and wait (a lighter pipeline stage, a faster rank waiting in the
gradient all-reduce) computes more slowly and draws less, and the step takes no longer; with
a bounded slowdown every device may stretch its computing into the extra time. Perseus
measures each computation's time and energy at every clock; the planner has no device to
measure, so it uses the first-order model of a clock fraction r = f / f_max:

    compute seconds  busy_s / r                 (matmul-bound work runs at the clock's pace)
    power computing  idle_w + (busy_w - idle_w) x r^3
    energy computing idle_w x busy_s / r + (busy_w - idle_w) x busy_s x r^2

The cube is CMOS dynamic power, P = C V^2 f, with the supply voltage scaled in proportion to
the clock across the DVFS range (the relation DVFS rests on: power falls with the square of
the voltage, speed with the clock). Over the whole step every device draws idle_w (as in
energy.py), so lowering the clock changes the step's energy by the busy part only:
(busy_w - idle_w) x busy_s x (1 - r^2) saved per device, while the step stretches by whatever
the slack did not absorb.

The lowest clock considered is the cluster's `min_clock_fraction`: its GPU's base clock over
its boost clock, the range NVIDIA specifies for sustained operation under TDP (below it the
voltage floor makes power fall only linearly, and the cube model stops holding). 0: the clocks
of that cluster are not lowered (no published base clock here).

Not modelled: memory-bound work (element-wise passes, the optimizer) slows less than the clock;
the clock changes' own latency (Perseus plans per computation; here one clock per device for
its whole step); static power falling a little with the voltage. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.planner.cost import Estimate
from phalanx.planner.hardware import Cluster

POWER_EXPONENT = 3
"""Dynamic power against the clock fraction: f x V^2 with V proportional to f."""


def clock_fraction(busy_s: float, allowed_s: float, floor: float) -> float:
    """The slowest clock (a fraction of the maximum) at which `busy_s` seconds of computing at
    full clock fit in `allowed_s`, but not below `floor`; 1 when there is no room or no floor."""
    if floor <= 0 or busy_s <= 0 or allowed_s <= busy_s:
        return 1.0
    return max(floor, busy_s / allowed_s)


def busy_energy_j(busy_s: float, r: float, *, idle_w: float, busy_w: float) -> float:
    """Joules above idle one device spends computing `busy_s` seconds (at full clock) at the
    clock fraction r: (busy_w - idle_w) x r^3 for busy_s / r seconds."""
    return (busy_w - idle_w) * busy_s * r ** (POWER_EXPONENT - 1)


@dataclass(frozen=True)
class Clocked:
    """A plan's step with clocks lowered."""
    fraction: float
    """The clock fraction of its devices (the most loaded one's, for uneven stages)."""
    step_time_s: float
    energy_j: float
    full_clock_energy_j: float

    @property
    def saved(self) -> float:
        return 1 - self.energy_j / self.full_clock_energy_j if self.full_clock_energy_j else 0.0


def homogeneous(est: Estimate, busy: float, cluster: Cluster, bound_s: float) -> Clocked:
    """Every device of a homogeneous plan is timed as the most loaded one (cost.py), so none
    has slack of its own: the room is the bound's, `bound_s - step` (F x the fastest plan's
    step, `--max-slowdown F`), into which every device stretches its `busy` seconds alike."""
    r = clock_fraction(busy, busy + max(0.0, bound_s - est.step_time_s), cluster.min_clock_fraction)
    step = est.step_time_s + busy * (1 / r - 1)
    n = est.world_size
    full = n * (cluster.idle_w * est.step_time_s + busy_energy_j(busy, 1.0, idle_w=cluster.idle_w, busy_w=cluster.busy_w))
    energy = n * (cluster.idle_w * step + busy_energy_j(busy, r, idle_w=cluster.idle_w, busy_w=cluster.busy_w))
    return Clocked(fraction=r, step_time_s=step, energy_j=energy, full_clock_energy_j=full)


def pipeline_stages(stage_s: list[float], floors: list[float], *, microbatches: int, slowdown_s: float = 0.0
                    ) -> list[float]:
    """Clock fractions of uneven pipeline stages (per micro-batch times `stage_s` at full clock):
    under 1F1B the steady state runs at the slowest stage's pace, so a stage with less work per
    micro-batch has that difference as slack each micro-batch and runs at t_s / t_max. With
    `slowdown_s` more per step, the pace itself may stretch by slowdown_s / (m + p - 1), the
    micro-batch slots on the critical path."""
    pace = max(stage_s) + slowdown_s / (microbatches + len(stage_s) - 1)
    return [clock_fraction(t, pace, floor) for t, floor in zip(stage_s, floors)]


def saved_busy_energy_j(busy_s: float, r: float, cluster: Cluster) -> float:
    """Joules one device saves computing `busy_s` seconds (at full clock) at the fraction r
    instead of the full clock, its slack absorbing the longer computing."""
    return busy_energy_j(busy_s, 1.0, idle_w=cluster.idle_w, busy_w=cluster.busy_w) - \
        busy_energy_j(busy_s, r, idle_w=cluster.idle_w, busy_w=cluster.busy_w)
