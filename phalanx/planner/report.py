"""Turning estimates into the `plan` command's table, JSON (the JSON names are an API) and
the explanation of the ranking, for one homogeneous cluster; a mixed cluster file's plans are
reported by mixed_report.py, with the same names where they mean the same (`energy_j_per_step`,
`energy_j_per_token`, `cost_usd_per_mtok`, `clocked_*`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.planner.cost import Estimate
from phalanx.planner.energy import Objective, busy_seconds, cost_usd_per_mtok, energy_per_step_j
from phalanx.planner.hardware import Cluster

if TYPE_CHECKING:
    from phalanx.planner.search import SearchResult


def plan_record(est: Estimate, band: float = 0.0, *, cluster: Cluster | None = None,
                price: float | None = None, objective: Objective | None = None) -> dict:
    """One plan as JSON: scripts depend on these names. `band`: the step time's error band
    (a fraction, from validation.step_time_band). With the `cluster`, its energy (null where the
    cluster gives no power); with a `price` per GPU hour, its cost per million tokens (else null);
    ranked by energy under --max-slowdown, its lowered clock, step and energy (else null)."""
    lay = est.layout
    energy = energy_per_step_j(est, cluster) if cluster is not None else None
    lowered = objective.clocked(est) if objective is not None else None
    return {
        "dp": lay.dp, "cp": lay.cp, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "mbs": lay.mbs,
        "microbatches": lay.microbatches, "schedule": lay.schedule, "virtual": lay.virtual,
        "recompute": lay.recompute, "recompute_layers": lay.recompute_layers, "fsdp": lay.zero == 3, "zero": lay.zero, "sp": lay.sp,
        "replicate": lay.replicate, "ep_over_tp": lay.ep_over_tp, "cp_ring": lay.cp_ring, "plan": lay.plan_string(), "fix": lay.to_string(),
        "step_time_s": est.step_time_s, "step_time_band": band, "tokens_per_s": est.tokens_per_s,
        "tflops_per_gpu": est.tflops_per_gpu, "mfu": est.mfu,
        "memory_gib_per_gpu": est.memory_gib,
        "breakdown": dict(est.breakdown),
        "memory_breakdown_gib": {k: v / 2**30 for k, v in est.memory_breakdown.items()},
        "busy_fraction": busy_seconds(est) / est.step_time_s,
        "energy_j_per_step": energy,
        "energy_j_per_token": energy / est.tokens if energy is not None else None,
        "cost_usd_per_mtok": cost_usd_per_mtok(est, price) if price else None,
        "clock_fraction": lowered.fraction if lowered else None,
        "clocked_step_time_s": lowered.step_time_s if lowered else None,
        "clocked_energy_j_per_step": lowered.energy_j if lowered else None,
    }


COLUMNS = ("#", "dp", "cp", "tp", "pp", "ep", "mbs", "mb", "schedule", "v", "recompute", "zero",
           "step", "tokens/s", "TFLOP/s/GPU", "MFU", "GiB/GPU")


def step_time_text(seconds: float, band: float) -> str:
    """`12.4 s ±7%`: the predicted step time and how far such predictions have been off."""
    return f"{seconds:.4g} s ±{band:.0%}"


def columns(*, priced: bool = False) -> tuple[str, ...]:
    """The table's header: COLUMNS, energy per token, and the cost with a price."""
    return (*COLUMNS, "J/token", *(("$/Mtok",) if priced else ()))


def table_rows(ranked: list[Estimate], band: float = 0.0, *, cluster: Cluster | None = None,
               price: float | None = None) -> list[list[str]]:
    """One row per plan: COLUMNS' cells, then (with the cluster) J/token, "-" without its power,
    and (with a price) $/Mtok."""
    rows = []
    for i, est in enumerate(ranked, start=1):
        lay = est.layout
        cp = f"{lay.cp} ring" if lay.cp_ring else str(lay.cp)  # cp_ring=true: keys around a ring, not gathered
        rows.append([str(i), str(lay.dp), cp, str(lay.tp), str(lay.pp), str(lay.ep), str(lay.mbs),
                     str(lay.microbatches), lay.schedule if lay.pp > 1 else "-", str(lay.virtual),
                     f"{lay.recompute}:{lay.recompute_layers}" if lay.recompute_layers else lay.recompute, str(lay.zero), step_time_text(est.step_time_s, band), f"{est.tokens_per_s:,.0f}",
                     f"{est.tflops_per_gpu:.1f}", f"{est.mfu:.1%}", f"{est.memory_gib:.1f}"])
        if cluster is not None:
            energy = energy_per_step_j(est, cluster)
            rows[-1].append(f"{energy / est.tokens:.4g}" if energy is not None else "-")
            if price:
                rows[-1].append(f"{cost_usd_per_mtok(est, price):.4g}")
    return rows


def format_table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def explain(result: SearchResult, usable_gib: float, objective: Objective = Objective()) -> list[str]:
    """One line per runner-up: the cost that makes it slower than the winner (or, ranking by
    energy or cost, what makes it spend more)."""
    if not result.ranked:
        return []
    if objective.kind != "time" or objective.max_slowdown is not None:
        return _explain_objective(result, objective) + _explain_tail(result, usable_gib)
    best = result.ranked[0]
    top = max(best.breakdown, key=best.breakdown.get)
    lines = [f"#1 spends most of its {best.step_time_s:.3g} s step on {top} "
             f"({best.breakdown[top] / best.step_time_s:.0%}); the others lose to it on:"]
    for rank, est in enumerate(result.ranked[1:], start=2):
        diffs = {k: est.breakdown[k] - best.breakdown[k] for k in best.breakdown}
        cause = max(diffs, key=diffs.get)
        gap = est.step_time_s - best.step_time_s
        lines.append(f"#{rank} +{gap:.3g} s: mostly {cause} (+{diffs[cause]:.3g} s)")
    return lines + _explain_tail(result, usable_gib)


def _explain_tail(result: SearchResult, usable_gib: float) -> list[str]:
    """What every objective's explanation ends with: offload, and a faster layout memory pruned."""
    lines = []
    if result.offload_only:
        lines.append(f"offload=true: no layout fits in {usable_gib:.1f} GiB per device with its weights, gradients "
                     "and optimizer state there, so these keep their shards on the host (zero=3)")
    if result.fastest_pruned:
        fp = result.fastest_pruned
        lines.append(f"faster but pruned: {fp.layout.to_string()} would take {fp.step_time_s:.3g} s "
                     f"but needs {fp.memory_gib:.1f} GiB of {usable_gib:.1f} usable")
    return lines


def _explain_objective(result: SearchResult, objective: Objective) -> list[str]:
    """Why #1 wins on energy or cost: its figure against the fastest plan's, and for each
    runner-up whether it spends more by a longer step (every device drawing at least idle power
    for longer) or by more busy seconds (recompute, a heavier stage)."""
    best, fastest = result.ranked[0], result.fastest or result.ranked[0]
    unit = {"energy": "J/token", "cost": "$/Mtok", "time": "s"}[objective.kind]

    def per(est: Estimate) -> float:
        v = objective.value(est)
        return v / est.tokens if objective.kind == "energy" else v

    bound = (f" among the plans within {objective.max_slowdown:g}x the fastest plan's step time"
             if objective.max_slowdown is not None else "")
    lines = [f"ranked by {objective.kind}{bound}: #1 takes {per(best):.4g} {unit}, busy "
             f"{busy_seconds(best) / best.step_time_s:.0%} of its {best.step_time_s:.4g} s step"]
    if (lowered := objective.clocked(best)) is not None:
        lines.append(f"clocks lowered into the slowdown bound (planner/clocks.py, power as the clock cubed): #1 "
                     f"computes at {lowered.fraction:.0%} of its maximum clock, its step {lowered.step_time_s:.4g} s, "
                     f"{lowered.saved:.1%} less energy than at full clock"
                     + (" (the base clock: no lower)" if lowered.fraction == objective.cluster.min_clock_fraction
                        else "")
                     + ("" if objective.cluster.min_clock_fraction else
                        f" ({objective.cluster.name} has no min_clock_fraction: clocks stay at their maximum)"))
    if fastest is best or fastest.layout == best.layout:
        lines.append("#1 is also the fastest plan")
    else:
        saved = 1 - per(best) / per(fastest)
        lines.append(f"the fastest plan, {fastest.layout.to_string()}, takes {fastest.step_time_s:.4g} s "
                     f"({best.step_time_s / fastest.step_time_s - 1:+.1%} for #1) but {per(fastest):.4g} {unit}: "
                     f"#1 spends {saved:.1%} less" + _why_energy(best, fastest, objective))
    for rank, est in enumerate(result.ranked[1:], start=2):
        gap = per(est) - per(best)
        lines.append(f"#{rank} +{gap:.3g} {unit} ({gap / per(best):+.1%})" + _why_energy(best, est, objective, short=True))
    return lines


def _why_energy(best: Estimate, other: Estimate, objective: Objective, short: bool = False) -> str:
    """Which part of `other`'s spend differs from `best`'s: idle power over a longer step, or
    busy power over more computing seconds (cost: only the step's length counts)."""
    if objective.kind != "energy" or objective.cluster is None:
        return f": its step is {other.step_time_s - best.step_time_s:+.3g} s" if short else ""
    c, n = objective.cluster, best.world_size
    d_step = other.step_time_s - best.step_time_s
    d_busy = busy_seconds(other) - busy_seconds(best)
    idle_part, busy_part = n * c.idle_w * d_step, n * (c.busy_w - c.idle_w) * d_busy
    if abs(busy_part) >= abs(idle_part):
        what = f"{d_busy:+.3g} s of computing per device (compute, recompute, optimizer)"
    else:
        what = f"a {d_step:+.3g} s step, every device drawing idle power meanwhile"
    return f": mostly {what}" if short else f"; the fastest plan's extra is mostly {what}"
