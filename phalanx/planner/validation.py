"""How far the planner's step times have been off, by the validation that applies to a cluster.

A preset's predictions are checked against published runs on such clusters
(benchmarks/planner_published.py); a calibrated or described cluster's against runs on this
machine (benchmarks/planner_local.py). Each benchmark writes its median |error| into
validation.json (`--record`) beside the source it came from (for presets, the hold-out half of
the published rows: runs no modelling decision looked at); the plan table shows it as the
step time's band (`12.4 s ±7%`) and the JSON as `step_time_band`, a fraction. The mixed-cluster
planner's check against published runs on mixed GPUs (benchmarks/planner_published_mixed.py)
is recorded beside them under "mixed".
"""

from __future__ import annotations

import json
from pathlib import Path

from phalanx.planner.hardware import PRESETS, Cluster

FILE = Path(__file__).with_name("validation.json")


def figures() -> dict:
    return json.loads(FILE.read_text())


def step_time_band(cluster: Cluster) -> float:
    """The median |error| of the validation that applies: published runs for a GPU preset,
    this machine's runs for anything else (a calibrated `local`, a file)."""
    kind = "published" if PRESETS.get(cluster.name) is cluster and cluster.name != "local" else "local"
    return float(figures()[kind]["median_abs_error"])


def record(kind: str, median: float, rows: int, source: str | None = None) -> None:
    """Write a benchmark's median into validation.json, with the line saying where it comes from
    (kept when not given)."""
    data = figures()
    data.setdefault(kind, {}).update(median_abs_error=round(median, 4), rows=rows)
    if source:
        data[kind]["source"] = source
    FILE.write_text(json.dumps(data, indent=2) + "\n")
