"""Energy and cost of a plan's step, and ranking plans by them (`--objective`, `--max-slowdown`).

Each device draws `idle_w` for the whole step and `busy_w - idle_w` more for the seconds it
computes (the cluster's figures, hardware.py, each preset naming its source):

    energy per step (J) = n_gpus x step_s x (idle_w + (busy_w - idle_w) x busy_s / step_s)
    energy per token    = energy per step / tokens per step
    cost per Mtok (USD) = price per GPU hour x n_gpus x step_s / 3600 / tokens per step x 1e6

busy_s is what the step model spends computing on a device: the layers' compute and recompute
and the optimizer step (`BUSY_KEYS` of the breakdown). Communication that is not hidden (tp,
ep, cp, pp, dp), the pipeline bubble and fixed framework overheads count as waiting, at
idle_w: a device in an exposed collective keeps a few SMs copying and polling while its tensor
cores, most of its power, are still. Communication hidden behind compute is inside compute's
seconds (cost.py charges its share of SMs there), so it is busy. Every rank is timed as the
most loaded stage's (as the step time is), so pipelines' lighter stages are counted busy a
little too long.

With `--objective energy --max-slowdown F`, each plan's devices run their computing at the
lowest clock that keeps its step within F x the fastest plan's (clocks.py: power against clock
as a cube, down to the cluster's base clock), and its energy is counted so.

A mixed cluster's plans (mixed_energy.py) use these same functions per dp rank or pipeline
stage, each with its own group's power and busy seconds, and one price per preset.

Not modelled: the power a device draws while waiting above its idle reading (clocks stay up),
draw below TDP while computing (training rarely holds TDP); CPUs, NICs, switches and
fans (the node's own power, the same per GPU-second for every layout, so it scales with step
time like idle_w: a cluster file can add it to idle_w and busy_w); the data centre's PUE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.errors import UserError
from phalanx.planner import clocks
from phalanx.planner.cost import Estimate
from phalanx.planner.hardware import Cluster

BUSY_KEYS = ("compute", "recompute", "optimizer")
"""The step's breakdown entries a device spends computing, at busy_w; the rest waits, at idle_w."""
OBJECTIVES = ("time", "energy", "cost")


def step_energy_j(*, n_gpus: int, step_s: float, busy_s: float, idle_w: float, busy_w: float) -> float:
    """Joules of one step over all devices: each draws idle_w throughout and busy_w - idle_w
    more for busy_s of the step."""
    return n_gpus * (idle_w * step_s + (busy_w - idle_w) * min(busy_s, step_s))


def busy_seconds(est: Estimate) -> float:
    """Seconds of the step a device computes (BUSY_KEYS of the breakdown)."""
    return sum(est.breakdown.get(key, 0.0) for key in BUSY_KEYS)


def has_power(cluster: Cluster) -> bool:
    return cluster.busy_w > 0


def energy_per_step_j(est: Estimate, cluster: Cluster) -> float | None:
    """Predicted joules of one step over all devices, or None where the cluster gives no power."""
    if not has_power(cluster):
        return None
    return step_energy_j(n_gpus=est.world_size, step_s=est.step_time_s, busy_s=busy_seconds(est),
                         idle_w=cluster.idle_w, busy_w=cluster.busy_w)


def step_cost_usd_per_mtok(*, usd_per_gpu_hour: float, n_gpus: int, step_s: float, tokens: int) -> float:
    """Dollars per million tokens of `n_gpus` devices held for a step of `step_s` at a price per
    GPU hour: GPU-hours of a step over its tokens."""
    return usd_per_gpu_hour * n_gpus * step_s / 3600 / tokens * 1e6


def cost_usd_per_mtok(est: Estimate, usd_per_gpu_hour: float) -> float:
    """Dollars per million tokens of a plan at a price per GPU hour."""
    return step_cost_usd_per_mtok(usd_per_gpu_hour=usd_per_gpu_hour, n_gpus=est.world_size,
                                  step_s=est.step_time_s, tokens=est.tokens)


def parse_prices(items: list[str] | None) -> dict[str, float]:
    """`--price PRESET=USD_PER_HOUR` (repeatable) -> {cluster name: dollars per GPU hour}."""
    prices: dict[str, float] = {}
    for item in items or []:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UserError(f"--price {item!r}: expected CLUSTER=USD_PER_GPU_HOUR, e.g. --price dgx-h100=2.5")
        try:
            value = float(raw)
        except ValueError:
            raise UserError(f"--price {item!r}: {raw.strip()!r} is not a number of dollars per GPU hour") from None
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"--price {item!r}: dollars per GPU hour must be a positive finite number")
        if name in prices:
            raise UserError(f"--price names {name!r} twice ({prices[name]:g} and {value:g})")
        prices[name] = value
    return prices


@dataclass(frozen=True, kw_only=True)
class Objective:
    """What the search ranks by on one cluster: step time (the default), energy per step, or
    cost per token; with `max_slowdown`, only plans within that factor of the fastest plan's
    step time are ranked (a frontier over layouts: the least energy or cost at a bounded
    slowdown)."""

    kind: str = "time"
    max_slowdown: float | None = None
    cluster: Cluster | None = None
    """The cluster's power figures, for energy."""
    price: float | None = None
    """Dollars per GPU hour, for cost (and the cost column)."""

    bound_s: float | None = None
    """With max_slowdown: F x the fastest plan's step, the longest step allowed (set by rank)."""

    def clocked(self, est: Estimate) -> clocks.Clocked | None:
        """Energy with clocks lowered into the room the slowdown bound leaves (clocks.py), for
        `--objective energy --max-slowdown F`; None otherwise."""
        if self.kind != "energy" or self.bound_s is None or self.cluster is None or not has_power(self.cluster):
            return None
        return clocks.homogeneous(est, busy_seconds(est), self.cluster, self.bound_s)

    def value(self, est: Estimate) -> float:
        """The quantity ranked: seconds, joules per step (clocks lowered under a slowdown
        bound) or dollars per million tokens."""
        if self.kind == "energy":
            lowered = self.clocked(est)
            return lowered.energy_j if lowered else energy_per_step_j(est, self.cluster)  # type: ignore[return-value]
        if self.kind == "cost":
            return cost_usd_per_mtok(est, self.price)  # type: ignore[arg-type]
        return est.step_time_s

    def rank(self, fitting: list[Estimate]) -> list[Estimate]:
        """Best first; with max_slowdown only the plans within it of the fastest, energy then
        counted with each plan's clocks lowered to use the rest of the bound."""
        if not fitting:
            return []
        pool = fitting
        if self.max_slowdown is not None:
            fastest = min(e.step_time_s for e in fitting)
            object.__setattr__(self, "bound_s", self.max_slowdown * fastest)
            pool = [e for e in fitting if e.step_time_s <= self.max_slowdown * fastest * (1 + 1e-12)]
        return sorted(pool, key=lambda e: (self.value(e), e.step_time_s, e.memory_bytes))


def check_objective(kind: str, max_slowdown: float | None) -> None:
    """`--objective` is one of OBJECTIVES, and `--max-slowdown` a factor of at least 1 that goes
    with energy or cost (one-line errors); shared by the homogeneous and the mixed planner."""
    if kind not in OBJECTIVES:
        raise UserError(f"--objective {kind!r}: choose one of {', '.join(OBJECTIVES)}")
    if max_slowdown is not None:
        if kind == "time":
            raise UserError("--max-slowdown picks the least energy or cost among plans within that factor of the "
                            "fastest: add --objective energy or --objective cost")
        if not (math.isfinite(max_slowdown) and max_slowdown >= 1):
            raise UserError(f"--max-slowdown={max_slowdown:g} must be a finite factor of at least 1 (1.1: up to 10% "
                            "slower than the fastest plan)")


def objective_for(kind: str, max_slowdown: float | None, cluster: Cluster, prices: dict[str, float]) -> Objective:
    """The objective `phalanx plan` ranks `cluster`'s plans by; refused in one line where it
    cannot be priced (cost without a --price for the cluster, energy without its power)."""
    check_objective(kind, max_slowdown)
    if kind == "cost" and cluster.name not in prices:
        raise UserError(f"--objective cost needs a price for {cluster.name!r}: --price {cluster.name}=USD_PER_GPU_HOUR")
    if kind == "energy" and not has_power(cluster):
        raise UserError(f"--objective energy needs the power of {cluster.name!r}'s devices: give idle_w and busy_w "
                        "in a cluster file (docs/planner.md, Energy and cost)")
    return Objective(kind=kind, max_slowdown=max_slowdown, cluster=cluster, price=prices.get(cluster.name))


def check_prices(prices: dict[str, float], clusters: list[Cluster]) -> None:
    """Every --price names a cluster being planned (a typo would otherwise price nothing)."""
    names = [c.name for c in clusters]
    for name in prices:
        if name not in names:
            raise UserError(f"--price names {name!r}, which is not a cluster being planned ({', '.join(names)})")
