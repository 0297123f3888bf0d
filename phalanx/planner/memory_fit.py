"""Making a layout fit in memory: the fewest checkpointed blocks that do, and the single
changes (recompute, zero level, micro-batch size) that would make a pruned `--fix` fit."""

from __future__ import annotations

import math

from phalanx.model.config import ModelConfig
from phalanx.planner.cost import Estimate, evaluate
from phalanx.planner.hardware import Cluster
from phalanx.planner.layout import Workload
from phalanx.planner.options import Options
from phalanx.planner.peak_memory import memory_breakdown
from phalanx.planner.slot_layouts import slots_problem


def fewest_recomputed_layers(model: ModelConfig, cluster: Cluster, workload: Workload, full: Estimate,
                              options: Options) -> Estimate | None:
    """The layout of `full` (every block recomputed, fitting) with the fewest checkpointed
    blocks per chunk that still fits (`recompute_layers`), when that is some but not all; else None.

    Memory falls linearly with the checkpointed blocks, so two memory figures (1 block, all)
    place the answer; a step or two up covers rounding. Only the answer is priced."""
    lay = full.layout
    chunk = math.ceil(model.n_layers / (lay.pp * lay.virtual))
    if lay.recompute == "none" or lay.recompute_layers or chunk < 2:
        return None
    usable = cluster.usable_bytes

    def memory(k: int) -> float:
        return sum(memory_breakdown(model, workload, lay.replace(recompute_layers=k), options).values())

    one = memory(1)
    if one <= usable:
        return evaluate(model, cluster, workload, lay.replace(recompute_layers=1), options)
    k = 1 + math.ceil((one - usable) / ((one - full.memory_bytes) / (chunk - 1)))
    for _ in range(2):  # rounding: a step or two up
        if k >= chunk:
            return None
        if memory(k) <= usable:
            return evaluate(model, cluster, workload, lay.replace(recompute_layers=k), options)
        k += 1
    # Beyond that, bisect (memory never rises with k): a chunk may hold 10^11 layers.
    low, high = k, chunk  # memory(low - 1) does not fit; memory(chunk) (all) does
    while low < high:
        mid = (low + high) // 2
        if memory(mid) <= usable:
            high = mid
        else:
            low = mid + 1
    if low >= chunk:
        return None
    return evaluate(model, cluster, workload, lay.replace(recompute_layers=low), options)


def fit_hints(model: ModelConfig, cluster: Cluster, workload: Workload, est: Estimate,
              options: Options = Options()) -> list[str]:
    """For a layout that does not fit: single changes that make it fit, with their GiB and time."""
    lay = est.layout
    tries = []
    if lay.recompute != "full" or lay.recompute_layers:
        tries.append(lay.replace(recompute="full", recompute_layers=0))
    tries += [lay.replace(zero=z) for z in (2, 3) if z > lay.zero]
    if lay.mbs > 1:
        tries.append(lay.replace(mbs=1, microbatches=lay.microbatches * lay.mbs))
    out = []
    for alt in tries:
        if slots_problem(model, alt, options):
            continue  # e.g. zero 2/3 with edp dividing neither expert dim (layout_rules)
        other = evaluate(model, cluster, workload, alt, options)
        if other.fits:
            out.append(f"{alt.to_string()} ({other.memory_gib:.1f} GiB, {other.step_time_s:.4g} s)")
    return out
