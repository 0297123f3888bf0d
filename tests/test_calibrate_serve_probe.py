"""`phalanx calibrate --serve`'s probe of a real server (phalanx/calibrate/serve_probe.py): one
`phalanx serve` of one process on 127.0.0.1 (the `tiny` preset's shape, random weights), eight
streamed requests (a warm-up, three one at a time, four at once). The fitted constants make
the planner predict the probe's own medians (exactly, or above where an extra was clipped at
0), and the file written is what `--cluster local` reads. No timing is asserted: only that
the measurements are what the fit reproduces."""

from __future__ import annotations

import asyncio
import math

import pytest

from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.serve.costs import ServeCosts, serve_costs_for
from phalanx.planner.serve.fit import fit_probe, predicted_latency


def test_a_real_server_is_probed_and_its_costs_written_for_the_local_cluster(tmp_path, monkeypatch):
    from phalanx.calibrate.serve_probe import probe_model_folder, probe_server
    from phalanx.calibrate.serve_steps import write_serve_costs
    from phalanx.planner.serve.costs import serve_costs_path

    model, cluster = MODELS["tiny"], CLUSTERS["local"]
    folder = probe_model_folder(model, tmp_path / "model")
    probe = asyncio.run(probe_server(folder, tp=1, vocab=model.vocab_size, env={"OMP_NUM_THREADS": "1"},
                                     log=lambda line: None))
    assert probe.burst == 4 and all(0 < x < math.inf for x in (probe.ttft_s, probe.tpot_s, probe.burst_tpot_s))
    base = ServeCosts(flops_scale=0.2, bandwidth_scale=0.2)
    costs = fit_probe(model, cluster, base, probe)
    ttft, tpot = predicted_latency(model, cluster, costs, probe)
    # Each added cost is what closes the gap to the measurement, or 0 when the base is already
    # above it (1e-4: the per-request cost, fitted after the TPOT, moves the vanishing rate's
    # running batch and so the TPOT by ~1e-6).
    assert tpot == pytest.approx(probe.tpot_s, rel=1e-4) or (costs.step_s == 0 and tpot > probe.tpot_s)
    assert ttft == pytest.approx(probe.ttft_s, rel=1e-4) or (costs.request_s == 0 and ttft > probe.ttft_s)

    monkeypatch.setenv("PHALANX_HOME", str(tmp_path))
    import dataclasses

    write_serve_costs({**dataclasses.asdict(costs), "source": "test"}, serve_costs_path())
    assert serve_costs_for(cluster) == costs


def test_bad_calibrate_serve_flags_are_one_line_before_any_timing(tmp_path, capsys):
    from phalanx.testing.cli_errors import assert_cli_error

    assert_cli_error(["calibrate", "--serve", "--max-procs", "0"], capsys, "--max-procs 0", "tp group probed")
    assert_cli_error(["calibrate", "--serve", "--out", str(tmp_path)], capsys, "is a folder")


def test_calibration_asks_the_engine_whether_a_step_of_decodes_and_a_prompt_is_two_forwards(monkeypatch):
    """`engine_splits_forwards` asks the engine's own step_forwards with a step of a decode and a
    prompt chunk: True where it makes two forwards of them, False where it packs both in one
    (what the planner then prices: ServeCosts.split_forwards)."""
    import phalanx.serve.input_batch as engine
    from phalanx.calibrate.serve_steps import engine_splits_forwards

    real = engine.step_forwards
    for count in (1, 2):
        monkeypatch.setattr(engine, "step_forwards", lambda step, count=count: (real(step)[0][:1] * count, []))
        assert engine_splits_forwards() is (count == 2)
