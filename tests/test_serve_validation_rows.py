"""The published serving runs the planner is checked on (phalanx/planner/serve/validation.json,
benchmarks/serve_planner_published.py): each row names its source and engine and states the
whole configuration the planner needs; half of every source is held out; and the planner
refuses none of them (each really ran). Torch-free; the predictions' accuracy is the
benchmark's to print, not a test's to pin."""

from __future__ import annotations

import collections
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_planner_published import ROWS, predict, source_name  # noqa: E402

from phalanx.model.config import PRESETS as MODELS  # noqa: E402
from phalanx.planner.hardware import PRESETS as CLUSTERS  # noqa: E402

DATA = json.loads(ROWS.read_text())
METRICS = ("output_tokens_per_s_total", "output_tokens_per_s_per_gpu", "input_tokens_per_s_per_gpu")


def test_every_row_states_its_run():
    ids = [row["id"] for row in DATA["rows"]]
    assert len(ids) == len(set(ids)), [i for i, n in collections.Counter(ids).items() if n > 1]
    for row in DATA["rows"]:
        assert row["split"] in ("visible", "holdout"), row["id"]
        assert row["source"] and row["engine"], row["id"]
        assert row["model"] in MODELS or row["model"] in DATA["models"], row["id"]
        assert row["cluster"] in CLUSTERS and row["weight_dtype"] in ("bf16", "fp8", "fp4"), row["id"]
        assert row["metric"] in METRICS and row["measured"] > 0, row["id"]
        assert row["isl"] >= 1 and row["osl"] >= 1 and row["gpus"] >= 1, row["id"]
        assert row["phase"] in ("both", "prefill", "decode") and row["fix"], row["id"]


def test_half_of_every_source_is_held_out():
    """Per source, the halves differ by at most one row (an odd count)."""
    halves = collections.defaultdict(collections.Counter)
    for row in DATA["rows"]:
        halves[source_name(row)][row["split"]] += 1
    assert len(halves) >= 3, halves
    for source, count in halves.items():
        assert abs(count["visible"] - count["holdout"]) <= 1, (source, count)


@pytest.mark.parametrize("split", ["visible", "holdout"])
def test_no_published_run_is_refused(split):
    """Each row ran, so the planner must find a layout for it (a memory model that refuses a
    run that fit is wrong whatever its error elsewhere)."""
    refused = [row["id"] for row in DATA["rows"] if row["split"] == split
               and math.isnan(predict(row, DATA["models"], "fp8")[0])]
    assert not refused, refused
