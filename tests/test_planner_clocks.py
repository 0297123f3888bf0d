"""Clocks lowered where a device has slack (planner/clocks.py): the cube-law energy on
hand-computable steps, the frontier `--objective energy --max-slowdown F` ranks by, and the
mixed planner's uneven pipeline stages. Torch-free."""

import dataclasses
import json

import pytest

from phalanx import cli
from phalanx.model.by_name import model_config
from phalanx.plan import Plan
from phalanx.planner import clocks
from phalanx.planner.cost import evaluate
from phalanx.planner.energy import Objective
from phalanx.planner.hardware import PRESETS, cluster_to_dict
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.mixed_cluster import Group, MixedCluster
from phalanx.planner.mixed_dp import rank_parts
from phalanx.planner.mixed_energy import energy_detail

H100 = PRESETS["dgx-h100"]
POWERED = dataclasses.replace(H100, idle_w=100.0, busy_w=700.0, min_clock_fraction=0.5)


def _estimate(step_s: float, breakdown: dict[str, float], *, world: int = 8):
    est = evaluate(model_config("tiny"), H100, Workload(global_batch=8, seq_len=128), Layout(Plan(dp=8), mbs=1))
    return dataclasses.replace(est, step_time_s=step_s, breakdown=breakdown, world_size=world)


def test_clock_fraction_fills_the_room_down_to_the_floor():
    assert clocks.clock_fraction(0.8, 1.0, 0.5) == pytest.approx(0.8)
    assert clocks.clock_fraction(0.8, 1.0, 0.9) == 0.9  # the base clock: no lower
    assert clocks.clock_fraction(0.8, 0.8, 0.5) == 1.0  # no room
    assert clocks.clock_fraction(0.8, 2.0, 0.0) == 1.0  # no floor known: clocks stay up


def test_homogeneous_plan_stretches_its_computing_into_the_bound():
    """Step 1.0 s, 0.8 s of it computing, bound 1.1 s: the devices compute at r = 0.8 / 0.9 and
    the step takes 1.0 + 0.8 x (1/r - 1) = 1.1 s. Per GPU at full clock 100 x 1.0 + 600 x 0.8 =
    580 J; lowered 100 x 1.1 + 600 x 0.8 x r^2 = 489.26 J, 15.6% less (8 GPUs: x 8)."""
    est = _estimate(1.0, {"compute": 0.8, "dp_comm": 0.2})
    lowered = clocks.homogeneous(est, 0.8, POWERED, 1.1)
    r = 0.8 / 0.9
    assert lowered.fraction == pytest.approx(r)
    assert lowered.step_time_s == pytest.approx(1.1)
    assert lowered.full_clock_energy_j == pytest.approx(8 * 580.0)
    assert lowered.energy_j == pytest.approx(8 * (110.0 + 480.0 * r * r))
    assert lowered.saved == pytest.approx(1 - (110.0 + 480.0 * r * r) / 580.0)
    at_bound = clocks.homogeneous(est, 0.8, POWERED, 1.0)  # no slowdown allowed: nothing changes
    assert at_bound.fraction == 1.0 and at_bound.energy_j == at_bound.full_clock_energy_j


def test_pipeline_stages_run_at_the_slowest_stages_pace():
    """Per micro-batch 2, 1 and 1.5 s: the steady state runs at 2 s, so the others compute at
    1/2 and 3/4 of the clock (floor 0.6: the second at 0.6). With 10 s more allowed over
    m + p - 1 = 8 + 3 - 1 = 10 slots, the pace is 3 s: 2/3, floor, 1/2 -> floor."""
    assert clocks.pipeline_stages([2.0, 1.0, 1.5], [0.5] * 3, microbatches=8) == pytest.approx([1.0, 0.5, 0.75])
    assert clocks.pipeline_stages([2.0, 1.0, 1.5], [0.6] * 3, microbatches=8) == pytest.approx([1.0, 0.6, 0.75])
    assert clocks.pipeline_stages([2.0, 1.0, 1.5], [0.6] * 3, microbatches=8, slowdown_s=10.0) == \
        pytest.approx([2 / 3, 0.6, 0.6])
    # Saved per device computing 3 s of work at r = 0.5: 600 W x 3 s x (1 - 0.25) = 1,350 J.
    assert clocks.saved_busy_energy_j(3.0, 0.5, POWERED) == pytest.approx(1350.0)


def test_frontier_counts_lowered_clocks_when_ranking():
    """A: a 1.0 s step computing all of it; B: 1.05 s computing 0.7 s. Within 1.1x of A's step
    (bound 1.1 s), A computes at 1/1.1 and B at 0.7/0.75: per GPU A 100 x 1.1 + 600 x 1.0 /
    1.21 = 605.9 J, B 100 x 1.1 + 600 x 0.7 x (0.7/0.75)^2 = 475.9 J."""
    a = _estimate(1.0, {"compute": 1.0})
    b = _estimate(1.05, {"compute": 0.7, "bubble": 0.35})
    objective = Objective(kind="energy", cluster=POWERED, max_slowdown=1.1)
    assert objective.rank([a, b]) == [b, a]
    assert objective.value(a) == pytest.approx(8 * (110.0 + 600.0 / 1.21))
    assert objective.value(b) == pytest.approx(8 * (110.0 + 420.0 * (0.7 / 0.75) ** 2))
    assert Objective(kind="energy", cluster=POWERED).clocked(a) is None  # no bound: clocks are not lowered


def test_plan_json_and_text_report_the_lowered_clocks(capsys):
    args = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "256",
            "--seq-len", "4096", "--top", "3", "--objective", "energy", "--max-slowdown", "1.05"]
    assert cli.run(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    bound = 1.05 * min(p["step_time_s"] for p in data["plans"])
    for plan in data["plans"]:
        assert H100.min_clock_fraction <= plan["clock_fraction"] <= 1.0
        assert plan["clocked_step_time_s"] <= bound * (1 + 1e-9)
        assert plan["clocked_energy_j_per_step"] <= plan["energy_j_per_step"]
    energies = [p["clocked_energy_j_per_step"] for p in data["plans"]]
    assert energies == sorted(energies)
    assert cli.run(args) == 0
    assert "computes at" in capsys.readouterr().out


def test_without_a_clock_floor_the_frontier_chooses_among_layouts_only(tmp_path, capsys):
    """A cluster file with min_clock_fraction 0: clocks stay at their maximum and --max-slowdown
    ranks layouts alone (llama3-8b on 8 H100s: dp=8 spends fewer joules than the fastest plan)."""
    path = tmp_path / "h100-fixed-clocks.json"
    path.write_text(json.dumps({**cluster_to_dict(dataclasses.replace(H100, min_clock_fraction=0.0)),
                                "name": "h100-fixed-clocks"}))
    args = ["plan", "--model", "llama3-8b", "--cluster", str(path), "--gpus", "8", "--global-batch", "256",
            "--seq-len", "4096", "--top", "3", "--json"]
    assert cli.run(args) == 0
    by_time = json.loads(capsys.readouterr().out)["plans"]
    assert cli.run(args + ["--objective", "energy", "--max-slowdown", "1.05"]) == 0
    by_energy = json.loads(capsys.readouterr().out)["plans"]
    assert by_energy[0]["fix"] != by_time[0]["fix"]
    assert all(p["clock_fraction"] == 1.0 for p in by_energy)
    assert by_energy[0]["energy_j_per_step"] < by_time[0]["energy_j_per_step"]


def test_mixed_pipeline_lighter_stage_gets_a_lower_clock(tmp_path, capsys):
    path = tmp_path / "mixed.toml"
    path.write_text('name = "h100+a100"\n[[groups]]\npreset = "dgx-h100"\nnodes = 1\n'
                    '[[groups]]\npreset = "dgx-a100"\nnodes = 1\n')
    assert cli.run(["plan", "--model", "llama3-8b", "--cluster", str(path), "--gpus", "16", "--global-batch", "64",
                    "--seq-len", "4096", "--top", "3", "--json"]) == 0
    plans = [p for p in json.loads(capsys.readouterr().out)["plans"] if p["kind"] == "pipeline"]
    assert plans
    for p in plans:
        times, fractions = p["stage_ms_per_microbatch"], p["stage_clock_fraction"]
        slowest = max(times)
        for t, r, g in zip(times, fractions, p["stage_groups"]):
            floor = (H100 if g == 0 else PRESETS["dgx-a100"]).min_clock_fraction
            assert r == pytest.approx(max(floor, t / slowest) if t < slowest else 1.0)
        assert p["clock_energy_saved_j_per_step"] >= 0
    assert any(r < 1 for p in plans for r in p["stage_clock_fraction"])  # the split leaves a stage slack


def test_uneven_dp_ranks_that_finish_early_get_lower_clocks():
    """Two ranks: A computes 1.0 s of a 1.2 s share time, B 0.5 s of 0.6 s. A is the slowest (no
    slack: full clock); B waits 0.6 s, so 0.5 / (0.5 + 0.6) = 0.45, held at the floor 0.5.
    B saves (700 - 100) x 0.5 x (1 - 0.5^2) = 225 J."""
    mixed = MixedCluster(name="two", groups=(Group("a", POWERED, 1), Group("b", POWERED, 1)), between_bw_gbs=47.0,
                         between_latency_us=8.0)
    a, b = _estimate(1.2, {"compute": 1.0, "overhead": 0.2}), _estimate(0.6, {"compute": 0.5, "overhead": 0.1})
    out = energy_detail(mixed, "dp", rank_parts([a, b], [1.2, 0.6], [0, 1]), 1.2, microbatches=1, tokens=1)
    assert out["clock_fraction_by_group"] == pytest.approx([1.0, 0.5])
    assert out["clock_energy_saved_j_per_step"] == pytest.approx(600.0 * 0.5 * 0.75)
