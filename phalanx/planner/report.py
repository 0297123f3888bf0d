"""Turning estimates into the `plan` command's table, JSON (the JSON names are an API) and
the explanation of the ranking."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.planner.cost import Estimate

if TYPE_CHECKING:
    from phalanx.planner.search import SearchResult


def plan_record(est: Estimate, band: float = 0.0) -> dict:
    """One plan as JSON: scripts depend on these names. `band`: the step time's error band
    (a fraction, from validation.step_time_band)."""
    lay = est.layout
    return {
        "dp": lay.dp, "cp": lay.cp, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "mbs": lay.mbs,
        "microbatches": lay.microbatches, "schedule": lay.schedule, "virtual": lay.virtual,
        "recompute": lay.recompute, "recompute_layers": lay.recompute_layers, "fsdp": lay.zero == 3, "zero": lay.zero, "sp": lay.sp,
        "replicate": lay.replicate, "ep_over_tp": lay.ep_over_tp, "plan": lay.plan_string(), "fix": lay.to_string(),
        "step_time_s": est.step_time_s, "step_time_band": band, "tokens_per_s": est.tokens_per_s,
        "tflops_per_gpu": est.tflops_per_gpu, "mfu": est.mfu,
        "memory_gib_per_gpu": est.memory_gib,
        "breakdown": dict(est.breakdown),
        "memory_breakdown_gib": {k: v / 2**30 for k, v in est.memory_breakdown.items()},
    }


COLUMNS = ("#", "dp", "cp", "tp", "pp", "ep", "mbs", "mb", "schedule", "v", "recompute", "zero",
           "step", "tokens/s", "TFLOP/s/GPU", "MFU", "GiB/GPU")


def step_time_text(seconds: float, band: float) -> str:
    """`12.4 s ±7%`: the predicted step time and how far such predictions have been off."""
    return f"{seconds:.4g} s ±{band:.0%}"


def table_rows(ranked: list[Estimate], band: float = 0.0) -> list[list[str]]:
    rows = []
    for i, est in enumerate(ranked, start=1):
        lay = est.layout
        rows.append([str(i), str(lay.dp), str(lay.cp), str(lay.tp), str(lay.pp), str(lay.ep), str(lay.mbs),
                     str(lay.microbatches), lay.schedule if lay.pp > 1 else "-", str(lay.virtual),
                     f"{lay.recompute}:{lay.recompute_layers}" if lay.recompute_layers else lay.recompute, str(lay.zero), step_time_text(est.step_time_s, band), f"{est.tokens_per_s:,.0f}",
                     f"{est.tflops_per_gpu:.1f}", f"{est.mfu:.1%}", f"{est.memory_gib:.1f}"])
    return rows


def format_table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def explain(result: SearchResult, usable_gib: float) -> list[str]:
    """One line per runner-up: the cost that makes it slower than the winner."""
    if not result.ranked:
        return []
    best = result.ranked[0]
    top = max(best.breakdown, key=best.breakdown.get)
    lines = [f"#1 spends most of its {best.step_time_s:.3g} s step on {top} "
             f"({best.breakdown[top] / best.step_time_s:.0%}); the others lose to it on:"]
    for rank, est in enumerate(result.ranked[1:], start=2):
        diffs = {k: est.breakdown[k] - best.breakdown[k] for k in best.breakdown}
        cause = max(diffs, key=diffs.get)
        gap = est.step_time_s - best.step_time_s
        lines.append(f"#{rank} +{gap:.3g} s: mostly {cause} (+{diffs[cause]:.3g} s)")
    if result.offload_only:
        lines.append(f"offload=true: no layout fits in {usable_gib:.1f} GiB per device with its weights, gradients "
                     "and optimizer state there, so these keep their shards on the host (zero=3)")
    if result.fastest_pruned:
        fp = result.fastest_pruned
        lines.append(f"faster but pruned: {fp.layout.to_string()} would take {fp.step_time_s:.3g} s "
                     f"but needs {fp.memory_gib:.1f} GiB of {usable_gib:.1f} usable")
    return lines
