"""Calibration of the serving engine's constants (planner/serve_fit.py, serve_costs.py),
without timing anything: steps made by the step model itself from known constants must be
fitted back to them, and a bad calibration file is a one-line error."""

from __future__ import annotations

import dataclasses
import json

import pytest

from phalanx.errors import UserError
from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.serve_costs import ServeCosts, load_serve_costs, serve_costs_for
from phalanx.planner.serve_fit import MeasuredStep, fit
from phalanx.planner.serve_step import ServeLayout, step_time


def test_fit_recovers_the_constants_that_made_the_steps():
    """Decode and prompt steps priced with known constants (rate scale 0.4, a per-step and a
    per-sequence-layer cost): the fit finds them within 2% and explains every step."""
    model, cluster = MODELS["small"], CLUSTERS["local"]
    layout = ServeLayout(weight_dtype="fp32", kv_dtype="fp32")
    truth = ServeCosts(step_s=3e-3, sequence_layer_s=2e-4, flops_scale=0.4, bandwidth_scale=0.4)
    shapes = [(b, c, 0, 0.0) for b in (1, 4, 16) for c in (32, 192)] + [(0, 0.0, t, t / 2) for t in (16, 64, 256)]
    steps = [MeasuredStep(b, c, t, pc, step_time(model, cluster, layout, decodes=b, context=c, prefill_tokens=t,
                                                 prefill_context=pc, costs=truth).seconds) for b, c, t, pc in shapes]
    costs, error = fit(model, cluster, steps, layout)
    assert error < 1e-6
    assert costs.flops_scale == pytest.approx(0.4, rel=0.02)
    assert costs.step_s == pytest.approx(3e-3, rel=0.02)
    assert costs.sequence_layer_s == pytest.approx(2e-4, rel=0.02)


def test_calibration_file_is_read_for_local_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_HOME", str(tmp_path))
    path = tmp_path / "serve-local.json"
    path.write_text(json.dumps({"step_s": 0.01, "group_step_s": [[2, 0.5]], "source": "test"}))
    costs = serve_costs_for(CLUSTERS["local"])
    assert costs.step_s == 0.01 and costs.group_step(2) == 0.5 and costs.group_step(4) == 0.0
    assert serve_costs_for(CLUSTERS["dgx-h100"]).group_step(2) == 0.0  # GPU presets never read it
    for bad, says in (({"step": 1}, "unknown key 'step'"), ({"step_s": -1}, "step_s=-1 must be"),
                      ({"group_step_s": [[1, 0.1]]}, "group of >= 2 ranks"), ({"group_step_s": 3}, "must be a list")):
        path.write_text(json.dumps(bad))
        with pytest.raises(UserError, match=says):
            load_serve_costs(path)
    assert dataclasses.asdict(costs)["group_step_s"] == ((2, 0.5),)
