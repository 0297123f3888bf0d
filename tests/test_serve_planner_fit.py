"""Calibration of the serving engine's constants (planner/serve/fit.py, serve/costs.py),
without timing anything: steps made by the step model itself from known constants must be
fitted back to them, and a bad calibration file is a one-line error."""

from __future__ import annotations

import dataclasses
import json

import pytest

from phalanx.errors import UserError
from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.serve.costs import ServeCosts, load_serve_costs, serve_costs_for
from phalanx.planner.serve.fit import MeasuredStep, fit
from phalanx.planner.serve.step import ServeLayout, step_time


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
    assert not costs.split_forwards  # a file written before the key: one forward per step, as then
    assert serve_costs_for(CLUSTERS["dgx-h100"]).group_step(2) == 0.0  # GPU presets never read it
    for bad, says in (({"step": 1}, "unknown key 'step'"), ({"step_s": -1}, "step_s=-1 must be"),
                      ({"group_step_s": [[1, 0.1]]}, "group of >= 2 ranks"), ({"group_step_s": 3}, "must be a list"),
                      ({"split_forwards": "yes"}, "split_forwards must be true or false")):
        path.write_text(json.dumps(bad))
        with pytest.raises(UserError, match=says):
            load_serve_costs(path)
    assert dataclasses.asdict(costs)["group_step_s"] == ((2, 0.5),)


def test_probe_fit_recovers_what_the_server_adds_to_the_engine_steps():
    """Latencies through a server priced with the engine's constants plus known extras (5 ms per
    step, 1 ms per sequence, 30 ms per request, 20 ms per step of a tp=2 group) are fitted back
    to those extras from the base constants, as `phalanx calibrate --serve` does with measured
    ones; an extra the steps already over-explain is clipped at 0, never negative."""
    from phalanx.planner.serve.fit import ServerProbe, fit_probe, predicted_latency

    model, cluster = MODELS["small"], CLUSTERS["local"]
    base = ServeCosts(step_s=1e-3, sequence_layer_s=1e-4, flops_scale=0.3, bandwidth_scale=0.3)
    truth = dataclasses.replace(base, step_s=6e-3, sequence_s=1e-3, request_s=0.03, group_step_s=((2, 0.02),))
    shape = dict(isl=64, osl=16, max_num_seqs=32, max_batch_tokens=512)

    def measured(tp: int, burst: int) -> ServerProbe:
        probe = ServerProbe(tp=tp, **shape, ttft_s=0, tpot_s=0, burst=burst)
        ttft, tpot = predicted_latency(model, cluster, truth, probe)
        burst_tpot = predicted_latency(model, cluster, truth, probe, burst=True)[1] if burst else 0.0
        return dataclasses.replace(probe, ttft_s=ttft, tpot_s=tpot, burst_tpot_s=burst_tpot)

    one = fit_probe(model, cluster, base, measured(1, 4))
    assert one.step_s == pytest.approx(6e-3, rel=1e-3) and one.sequence_s == pytest.approx(1e-3, rel=1e-3)
    assert one.request_s == pytest.approx(0.03, rel=1e-3) and one.group_step_s == ()
    both = fit_probe(model, cluster, one, measured(2, 0))
    assert both.group_step(2) == pytest.approx(0.02, rel=1e-3) and both.request_s == one.request_s
    fast = dataclasses.replace(measured(1, 4), tpot_s=1e-6, burst_tpot_s=1e-6, ttft_s=1e-6)
    clipped = fit_probe(model, cluster, base, fast)
    assert (clipped.step_s, clipped.sequence_s, clipped.request_s) == (base.step_s, base.sequence_s, 0.0)


def test_a_step_of_decodes_and_a_prompt_costs_both_forwards_where_the_engine_splits_them():
    """phalanx serve runs a step's decodes and its prompt chunk as two forwards
    (`split_forwards`, set by the fit): such a step costs exactly the two single-kind steps,
    the per-step host cost once; an engine that batches both in one forward (the GPU presets')
    costs less, the weights read and the group's cost paid once. For a load's mean step,
    `shares` scale only the per-forward costs: a prompt forward in a quarter of the steps adds
    a quarter of the tp group's per-forward cost and all of the prompt tokens' own costs."""
    model, cluster = MODELS["small"], CLUSTERS["local"]
    layout = ServeLayout(tp=2, weight_dtype="fp32", kv_dtype="fp32")
    split = ServeCosts(step_s=2e-3, sequence_s=1e-4, token_s=1e-5, group_step_s=((2, 0.05),), split_forwards=True)
    one_forward = dataclasses.replace(split, split_forwards=False)
    at = dict(context=80, prefill_context=32)

    def sec(costs, decodes, tokens, **kw):
        return step_time(model, cluster, layout, decodes=decodes, prefill_tokens=tokens, costs=costs, **at, **kw)

    both = sec(split, 3, 64).seconds
    assert both == pytest.approx(sec(split, 3, 0).seconds + sec(split, 0, 64).seconds - split.step_s, rel=1e-9)
    assert sec(one_forward, 3, 64).seconds < both - 0.05 + 1e-9
    framework = sec(split, 3, 16, shares=(1.0, 0.25)).breakdown["framework"]
    # step_s once; the group's cost for the decodes' forward and a quarter of it for the prompt's;
    # the sequences (3 decodes + a quarter of one prompt) and tokens (3 + 16) in full
    assert framework == pytest.approx(2e-3 + 0.05 * 1.25 + 1e-4 * 3.25 + 1e-5 * 19, rel=1e-9)


def test_a_prompt_that_finds_the_engine_idle_waits_for_no_step():
    """At a vanishing rate (the probe's one request at a time) the TTFT is the request's own
    cost and its prompt's step alone: no half step of waiting for a running step, no decodes'
    forward beside it (both scale with the chance that some sequence is running)."""
    from phalanx.planner.serve.fit import ServerProbe, predicted_latency

    model, cluster = MODELS["small"], CLUSTERS["local"]
    costs = ServeCosts(step_s=4e-3, request_s=0.01, group_step_s=((2, 0.05),), split_forwards=True)
    for tp in (1, 2):
        probe = ServerProbe(tp=tp, isl=64, osl=16, max_num_seqs=32, max_batch_tokens=512, ttft_s=0, tpot_s=0)
        prompt = step_time(model, cluster, ServeLayout(tp=tp, weight_dtype="fp32", kv_dtype="fp32"), decodes=0,
                           context=0, prefill_tokens=64, prefill_context=32, world=tp, costs=costs).seconds
        assert predicted_latency(model, cluster, costs, probe)[0] == pytest.approx(0.01 + prompt, rel=0.01)


def test_a_single_threaded_process_computes_at_one_cores_rate():
    """Steps timed on one thread of a 2-core node are one core's rate (world 2), so a tp=2 group
    of two single-threaded processes, each on its own core, runs a prompt's FLOPs in half the
    time; a one-process fit at world 1 would have made each rank half as fast and the tp=2
    prompt no faster. 4 processes on 2 cores: half a core each (world 4)."""
    import dataclasses as dc

    from phalanx.planner.serve.fit import compute_world

    model = MODELS["small"]
    cluster = dc.replace(CLUSTERS["local"], devices_per_node=2, fast_domain=2)
    assert [compute_world(cluster, p, 1) for p in (1, 2, 4)] == [2, 2, 4]
    assert [compute_world(cluster, p, 0) for p in (1, 2, 4)] == [1, 2, 4], "automatic: cores / processes"
    assert compute_world(cluster, 1, 2) == 1
    assert compute_world(CLUSTERS["dgx-h100"], 2, 1) == 2, "a GPU rank's rate is its own"
    layout = ServeLayout(weight_dtype="fp32", kv_dtype="fp32")
    truth = ServeCosts(flops_scale=0.4, bandwidth_scale=0.4)
    shapes = [(b, c, 0, 0.0) for b in (1, 4, 16) for c in (32, 192)] + [(0, 0.0, t, t / 2) for t in (16, 64, 256)]
    steps = [MeasuredStep(b, c, t, pc, step_time(model, cluster, layout, decodes=b, context=c, prefill_tokens=t,
                                                 prefill_context=pc, world=2, costs=truth).seconds)
             for b, c, t, pc in shapes]
    one_core, _ = fit(model, cluster, steps, layout, world=2)
    whole_node, _ = fit(model, cluster, steps, layout)
    prompt = lambda costs, tp, world: step_time(model, cluster, ServeLayout(tp=tp, weight_dtype="fp32", kv_dtype="fp32"),  # noqa: E731
                                                decodes=0, context=0, prefill_tokens=256, world=world,
                                                costs=costs).breakdown["weights_and_gemms"]
    assert prompt(one_core, 1, 2) == pytest.approx(prompt(whole_node, 1, 1), rel=1e-6), "same one-process prediction"
    # Half the FLOPs per rank (a little over half the time: narrower GEMMs run a little less
    # efficiently, hardware.Cluster.matmul_half_dim), against no faster at all.
    assert 0.5 <= prompt(one_core, 2, 2) / prompt(one_core, 1, 2) < 0.6
    assert prompt(whole_node, 2, 2) / prompt(whole_node, 1, 1) >= 1.0
