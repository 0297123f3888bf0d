"""Energy and cost of a mixed cluster's plans, and ranking them (`--objective energy|cost`,
`--max-slowdown F`): the homogeneous planner's model (energy.py, clocks.py), applied to each
`Part` of the plan (mixed_plan.py: a dp rank, or a pipeline stage) with its own group's power
and price.

    energy per step = sum over parts of energy.step_energy_j(its devices, the plan's step,
                      its busy seconds, its group's idle_w and busy_w)
    cost per Mtok   = sum over groups of energy.step_cost_usd_per_mtok(the group's price,
                      its devices, the plan's step, tokens per step)

A part's busy seconds are its group's model's compute, recompute and optimizer for its own
work: a dp rank's at its share (so a faster group's rank waits, at idle power, for the slowest
rank and in the all-reduce); a stage's time per micro-batch times the micro-batches, of which
its group's computing share (exposed tp collectives wait, as in energy.py), plus its optimizer
step scaled by its layers (the 1f1b bubble and the stage's wait for the slowest stage are idle).
A plan over the groups holds every group's devices for its whole step, so every device is
counted; a group alone (mixed_alone.py) holds only its own: the others are not held, so neither
paid for nor powered (released to other work).

Lowered clocks (clocks.py, Perseus's case): a part that finishes before the slowest computes
at the lowest clock its slack allows (`lower_clocks`, room 0: no cost in step time); its busy
joules fall by `clocks.saved_busy_energy_j`, summed as the plan's `clock_energy_saved_j_per_step`.
`energy_j_per_step` is at full clock (what `phalanx train` runs: it sets no clocks), so the
energy with the slack's clocks lowered is exactly `energy_j_per_step - clock_energy_saved_j_per_step`.
With `--objective energy --max-slowdown F` the parts may also stretch into the room the bound
leaves (F x the fastest plan's step less the plan's own), and plans rank by that clocked energy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.errors import UserError
from phalanx.planner import clocks
from phalanx.planner.energy import check_objective, check_prices, has_power, step_cost_usd_per_mtok, step_energy_j
from phalanx.planner.mixed_cluster import MixedCluster
from phalanx.planner.mixed_plan import MixedPlan, Part


def powered(mixed: MixedCluster) -> bool:
    """Whether every group gives its devices' power (else a plan's energy is unknown)."""
    return all(has_power(g.cluster) for g in mixed.groups)


def energy_j(mixed: MixedCluster, parts: tuple[Part, ...] | list[Part], step_s: float) -> float | None:
    """Joules of one step over every device at full clock; None where a group gives no power."""
    if not powered(mixed):
        return None
    return sum(step_energy_j(n_gpus=p.devices, step_s=step_s, busy_s=p.busy_s, idle_w=mixed.groups[p.group].cluster.idle_w,
                             busy_w=mixed.groups[p.group].cluster.busy_w) for p in parts)


def groups_used(parts) -> list[int]:
    """The groups whose devices a plan holds (every group, but for a group alone: mixed_alone.py)."""
    return sorted({p.group for p in parts})


def busy_fraction_by_group(mixed: MixedCluster, parts, step_s: float) -> list[float | None]:
    """Per group, the share of its device-seconds in the step spent computing (None for a group
    the plan leaves out)."""
    out: list[float | None] = []
    for g, group in enumerate(mixed.groups):
        mine = [p for p in parts if p.group == g]
        out.append(sum(p.devices * min(p.busy_s, step_s) for p in mine) / (sum(p.devices for p in mine) * step_s)
                   if mine else None)
    return out


@dataclass(frozen=True)
class Lowered:
    """A mixed plan's step with each part's clock lowered into its slack (and the room)."""
    fractions: tuple[float, ...]
    """Per part, its clock as a fraction of the maximum."""
    step_time_s: float
    saved_j: float
    """Busy joules the lower clocks save (over every device)."""
    energy_j: float | None
    """Joules of the clocked step (None without every group's power)."""


def lower_clocks(mixed: MixedCluster, kind: str, parts, step_s: float, *, microbatches: int,
                 room_s: float = 0.0) -> Lowered:
    """Each part at the slowest clock that keeps it within the slowest part's pace plus the room
    (clocks.clock_fraction, not below its group's `min_clock_fraction`). dp: a rank's wait for
    the slowest rank plus `room_s`, its whole busy time stretched; the step grows by what the
    slowest stretched rank adds. Pipeline: `clocks.pipeline_stages` (t_s over the pace, the pace
    stretched by room_s over the m + P - 1 micro-batch slots), each stage's computing per
    micro-batch stretched; the step grows by that many slots of the slowest stage's growth.
    With room_s = 0 the step does not change: only slack is used."""
    floors = [mixed.groups[p.group].cluster.min_clock_fraction for p in parts]
    slowest = max(p.pace_s for p in parts)
    if kind != "pipeline":  # dp ranks, or one group alone (one part: the homogeneous plan's clocks.homogeneous)
        fractions = [clocks.clock_fraction(p.clockable_s, p.clockable_s + slowest - p.pace_s + room_s, f)
                     for p, f in zip(parts, floors)]
        paces = [p.pace_s + p.clockable_s * (1 / r - 1) for p, r in zip(parts, fractions)]
        step = step_s + max(paces) - slowest
    else:
        fractions = clocks.pipeline_stages([p.pace_s for p in parts], floors, microbatches=microbatches,
                                           slowdown_s=room_s)
        paces = [p.pace_s + p.clockable_s / microbatches * (1 / r - 1) for p, r in zip(parts, fractions)]
        step = step_s + (microbatches + len(parts) - 1) * (max(paces) - slowest)
    saved = sum(p.devices * clocks.saved_busy_energy_j(p.clockable_s, r, mixed.groups[p.group].cluster)
                for p, r in zip(parts, fractions))
    full = energy_j(mixed, parts, step)
    return Lowered(fractions=tuple(fractions), step_time_s=step, saved_j=saved,
                   energy_j=full - saved if full is not None else None)


def energy_detail(mixed: MixedCluster, kind: str, parts: list[Part], step_s: float, *, microbatches: int,
                  tokens: int) -> dict:
    """The plan record's energy entries (docs/planner.md, Mixed clusters): energy at full clock
    per step and per token, each group's busy share, the clocks the slack allows (by group, the
    most loaded rank's, for dp; by stage for a pipeline) and the joules they save."""
    energy = energy_j(mixed, parts, step_s)
    slack = lower_clocks(mixed, kind, parts, step_s, microbatches=microbatches)
    if kind != "pipeline":
        clocks_entry = {"clock_fraction_by_group": [max((r for r, p in zip(slack.fractions, parts) if p.group == g),
                                                        default=None) for g in range(len(mixed.groups))]}
    else:
        clocks_entry = {"stage_clock_fraction": list(slack.fractions)}
    return {"energy_j_per_step": energy, "energy_j_per_token": energy / tokens if energy is not None else None,
            "busy_fraction_by_group": busy_fraction_by_group(mixed, parts, step_s), **clocks_entry,
            "clock_energy_saved_j_per_step": slack.saved_j if energy is not None else None}


def cost_usd_per_mtok(mixed: MixedCluster, plan: MixedPlan, prices: dict[str, float], tokens: int) -> float:
    """Dollars per million tokens: each group's devices the plan holds, for its step, at its
    preset's price per GPU hour (`check_mixed_prices` has made sure every group has one)."""
    return sum(step_cost_usd_per_mtok(usd_per_gpu_hour=prices[mixed.groups[g].cluster.name],
                                      n_gpus=mixed.groups[g].devices, step_s=plan.step_time_s, tokens=tokens)
               for g in groups_used(plan.parts))


def check_mixed_prices(prices: dict[str, float], mixed: MixedCluster) -> None:
    """`--price` names only the groups' presets, and, given at all, every one of them (a plan's
    cost holds every group's devices)."""
    presets = list({g.cluster.name: g.cluster for g in mixed.groups}.values())
    check_prices(prices, presets)
    if prices:
        for g in mixed.groups:
            if g.cluster.name not in prices:
                raise UserError(f"--price gives no price for group {g.name!r} (preset {g.cluster.name!r}) of "
                                f"{mixed.name!r}: add --price {g.cluster.name}=USD_PER_GPU_HOUR")


@dataclass(frozen=True, kw_only=True)
class MixedObjective:
    """What mixed plans rank by, as energy.Objective for one cluster: step time, energy per step
    (full clock; with max_slowdown, the clocks lowered into slack and the bound's room) or cost
    per million tokens; with max_slowdown only plans within that factor of the fastest."""
    kind: str = "time"
    max_slowdown: float | None = None
    prices: dict[str, float] = field(default_factory=dict)
    tokens: int = 1
    bound_s: float | None = None
    """With max_slowdown: F x the fastest plan's step, the longest allowed (set by `rank`)."""

    def clocked(self, mixed: MixedCluster, p: MixedPlan) -> Lowered | None:
        """The plan's clocks lowered into its slack and the bound's room, for `--objective energy
        --max-slowdown F`; None otherwise."""
        if self.kind != "energy" or self.bound_s is None or not p.parts:
            return None
        return lower_clocks(mixed, p.kind, p.parts, p.step_time_s, microbatches=p.plan.num_microbatches,
                            room_s=max(0.0, self.bound_s - p.step_time_s))

    def value(self, mixed: MixedCluster, p: MixedPlan) -> float:
        if self.kind == "energy":
            lowered = self.clocked(mixed, p)
            return lowered.energy_j if lowered else energy_j(mixed, p.parts, p.step_time_s)  # type: ignore[return-value]
        if self.kind == "cost":
            return cost_usd_per_mtok(mixed, p, self.prices, self.tokens)
        return p.step_time_s

    def rank(self, mixed: MixedCluster, plans: list[MixedPlan]) -> list[MixedPlan]:
        """Best first (ties: the faster)."""
        if not plans:
            return []
        pool = plans
        if self.max_slowdown is not None:
            fastest = min(p.step_time_s for p in plans)
            object.__setattr__(self, "bound_s", self.max_slowdown * fastest)
            pool = [p for p in plans if p.step_time_s <= self.max_slowdown * fastest * (1 + 1e-12)]
        return sorted(pool, key=lambda p: (self.value(mixed, p), p.step_time_s))


def mixed_objective(kind: str, max_slowdown: float | None, mixed: MixedCluster, prices: dict[str, float],
                    tokens: int) -> MixedObjective:
    """The objective `phalanx plan` ranks a mixed cluster's plans by; one-line errors where it
    cannot be counted (a group's preset without a price, or without power figures)."""
    check_objective(kind, max_slowdown)
    check_mixed_prices(prices, mixed)
    if kind == "cost" and not prices:
        first = mixed.groups[0].cluster.name
        raise UserError(f"--objective cost needs a price for every group's preset of {mixed.name!r}: "
                        f"--price {first}=USD_PER_GPU_HOUR and the like for "
                        + ", ".join(sorted({g.cluster.name for g in mixed.groups})))
    if kind == "energy":
        for g in mixed.groups:
            if not has_power(g.cluster):
                raise UserError(f"--objective energy needs the power of the devices of group {g.name!r} "
                                f"(preset {g.cluster.name!r}): give idle_w and busy_w in its cluster file "
                                "(docs/planner.md, Energy and cost)")
    return MixedObjective(kind=kind, max_slowdown=max_slowdown, prices=prices, tokens=tokens)
