"""The step simulator: its pipeline timelines reproduce the bubble formulas, and it writes files."""

import json
import types

import pytest

from phalanx import cli
from phalanx.planner.stage_time import StageTimes
from phalanx.planner.layout import Layout
from phalanx.planner.simulate import pipeline_timeline


def timeline_end(schedule, p, v, m, f=1.0, b=1.0, w=1.0):
    est = types.SimpleNamespace(layout=Layout(pp=p, virtual=v, schedule=schedule, microbatches=m),
                                stage=StageTimes(f=f, b=b, w=w, r=0.0))
    events, end = pipeline_timeline(est, 0.0)
    return events, end


@pytest.mark.parametrize("schedule, p, v, m, bubble", [
    ("1f1b", 4, 1, 8, 3 * 3.0),        # (p-1)(F+B+W)
    ("gpipe", 4, 1, 8, 3 * 3.0),
    ("interleaved", 4, 2, 8, 3 * 3.0 / 2),  # divided by v
    ("interleaved", 2, 4, 8, 1 * 3.0 / 4),
])
def test_simulated_bubble_matches_formula(schedule, p, v, m, bubble):
    events, end = timeline_end(schedule, p, v, m)
    assert end == pytest.approx(m * 3.0 + bubble)
    # Every micro-batch's forward and backward ran once per chunk on every rank.
    assert sum(e.kind == "F" for e in events) == p * v * m


def test_zero_bubble_v_beats_1f1b_and_runs_every_weight_gradient():
    events, end = timeline_end("zbv", 4, 2, 16)
    _, end_1f1b = timeline_end("1f1b", 4, 1, 16)
    assert sum(e.kind == "W" for e in events) == 4 * 2 * 16
    # Ideal 48; ZB-V leaves a short ramp (about one chunk per rank), far below 1F1B's 9.
    assert 48.0 <= end < 48.0 + 3.0 < end_1f1b
    # No rank runs two things at once.
    for rank in range(4):
        spans = sorted((e.start, e.end) for e in events if e.rank == rank and e.track == "compute")
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_simulate_command_writes_trace_and_png(tmp_path, capsys):
    out = tmp_path / "sim"
    code = cli.run(["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16",
                     "--seq-len", "2048", "--plan", "tp=2,pp=2,dp=2,mbs=1,schedule=1f1b", "--out", str(out)])
    assert code == 0
    trace = json.loads((out / "trace.json").read_text())
    kinds = {e.get("cat") for e in trace["traceEvents"]}
    assert {"F", "B", "idle", "optimizer", "tp/ep comm", "send"} <= kinds
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    simulated, model = (float(x.split()[0]) for x in printed.split("simulated step ")[1].split("; cost model "))
    assert simulated == pytest.approx(model, rel=0.02)  # 1F1B: the timeline and the formula agree


def test_dualpipev_runs_its_own_order_every_operation_once():
    from phalanx.planner.pipeline_orders import dualpipev_order

    p, m = 4, 8
    events, end = timeline_end("dualpipev", p, 2, m)
    # Every rank forwards and backs up each of its two chunks for every micro-batch, and runs
    # as many deferred weight gradients as input-only backwards.
    assert sum(e.kind == "F" for e in events) == 2 * p * m
    assert sum(e.kind == "B" for e in events) == 2 * p * m
    orders = [dualpipev_order(r, p, m) for r in range(p)]
    assert all(sum(k == "W" for k, _, _ in o) == sum(k == "I" for k, _, _ in o) for o in orders)
    # Rank 0 starts with 2(p-1) = 6 forwards of chunk 0, then its chunk 1 (stage 7) at once.
    assert [k for k, _, _ in orders[0][:8]] == ["F"] * 8 and orders[0][7][2] == 2 * p - 1
    # The last rank (the V's turn) has no warm-up of its own: F chunk 0, F chunk 1 (stage p).
    assert orders[-1][:2] == [("F", 0, p - 1), ("F", 0, p)]
    # DualPipeV keeps a bubble of its own, more than ideal, less than 1F1B's (p-1)(F+B+W) = 9:
    # at F = B = W its p - 1 chunk-sized forwards of ramp, 3 x 0.5.
    _, end_1f1b = timeline_end("1f1b", p, 1, m)
    assert end == pytest.approx(m * 3.0 + 1.5) and end < end_1f1b


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2)])
def test_more_pipeline_stages_at_fixed_microbatches_raise_the_bubble(schedule, v):
    # Stage times held fixed (F=1, B=1.5, W=1), 16 micro-batches: the simulated bubble (end
    # minus the ideal 16 x 3.5) grows with every doubling of pp, and so does the cost model's.
    from phalanx.planner.cost import _bubble

    st = StageTimes(f=1.0, b=1.5, w=1.0, r=0.0)
    sims, model = [], []
    for p in (2, 4, 8):
        _, end = timeline_end(schedule, p, v, 16, f=1.0, b=1.5, w=1.0)
        sims.append(end - 16 * 3.5)
        model.append(_bubble(schedule, p, v, st, 16))
    assert sims[0] < sims[1] < sims[2], sims
    assert model[0] <= model[1] <= model[2] and model[0] < model[2], model


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_cost_model_bubble_is_the_timelines(schedule):
    # The cost model times the V schedules' bubble on a few small timelines (pipeline_orders.
    # v_bubble: independent of m from 2p micro-batches on, scaled by F, linear in p past a few
    # ranks); here against the whole timeline at the real p and m, over stage-time ratios from
    # a light input gradient to a recompute-heavy one.
    from phalanx.planner.cost import _bubble

    for p in (2, 3, 5, 8, 13):
        for m in sorted({p if schedule == "zbv" else 2 * p, 2 * p, 3 * p + 1}):
            for f, b, w in ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 0.6, 1.3), (2.0, 5.0, 1.5), (1.0, 3.0, 0.5)):
                _, end = timeline_end(schedule, p, 2, m, f=f, b=b, w=w)
                st = StageTimes(f=f, b=b, w=w, r=0.0)
                assert _bubble(schedule, p, 2, st, m) == pytest.approx(end - m * (f + b + w), rel=1e-3, abs=1e-9), \
                    (p, m, f, b, w)
