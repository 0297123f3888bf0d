"""Energy and cost of mixed-cluster plans (issue 40 item 4 on item 3's plans): each dp rank or
pipeline stage counted by energy.py's model with its own group's power, cost from one price per
preset, `--objective energy|cost` and `--max-slowdown` ranking them.

The hand-computable cases give every figure: groups with made-up powers (idle 100 W / busy
700 W, idle 50 W / busy 400 W, clocks down to half), parts with given busy seconds; the sums
below are written out in each test's docstring. The search's own plans are checked against the
homogeneous model called directly (energy.energy_per_step_j, cost.evaluate), not against the
code under test.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from phalanx import cli
from phalanx.errors import UserError
from phalanx.plan import Plan, parse_shares
from phalanx.planner.cost import evaluate
from phalanx.planner.energy import busy_seconds, energy_per_step_j
from phalanx.planner.hardware import PRESETS
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.mixed_cluster import Group, MixedCluster, mixed_cluster_from_dict
from phalanx.planner.mixed_dp import dp_plans
from phalanx.planner.mixed_energy import (MixedObjective, cost_usd_per_mtok, energy_j, lower_clocks,
                                          mixed_objective)
from phalanx.planner.mixed_plan import MixedPlan, Part
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.options import trainer_options
from phalanx.planner.search import search

H100 = PRESETS["dgx-h100"]
# One device per node, so each group of one node is one device.
HUNGRY = dataclasses.replace(H100, name="hungry", devices_per_node=1, fast_domain=1, idle_w=100.0, busy_w=700.0, min_clock_fraction=0.5)
FRUGAL = dataclasses.replace(H100, name="frugal", devices_per_node=1, fast_domain=1, idle_w=50.0, busy_w=400.0, min_clock_fraction=0.5)
TWO = MixedCluster(name="two", groups=(Group("a", HUNGRY, 1), Group("b", FRUGAL, 1)), between_bw_gbs=47.0,
                   between_latency_us=8.0)
RATES = "devices_per_node = 8\nfast_domain = 8\nmemory_gib = 80\n"


def _options(cluster):
    return trainer_options("bf16", cluster)


def test_dp_energy_is_the_hand_sum_and_the_slack_clocks_save_what_they_say():
    """One device per group. a computes 1.0 s of its 1.0 s share, b 0.5 s of 0.5 s; the step is
    1.2 s (the all-reduce 0.2 s). At full clock:
        a: 100 x 1.2 + 600 x 1.0 = 720 J;  b: 50 x 1.2 + 350 x 0.5 = 235 J;  955 J.
    b waits 0.5 s for a: its clock 0.5 / (0.5 + 0.5) = 0.5 (the floor), saving 350 x 0.5 x
    (1 - 0.25) = 131.25 J at the same step. With 0.1 s of room (a bound of 1.3 s): a at
    1 / 1.1, b at 0.5 (its 0.5 / 1.1 below the floor); the step 1.3 s; energy
        100 x 1.3 + 600 x 1.0 / 1.1^2 + 50 x 1.3 + 350 x 0.5 x 0.25 = 734.62 J."""
    parts = [Part(group=0, devices=1, busy_s=1.0, pace_s=1.0, clockable_s=1.0),
             Part(group=1, devices=1, busy_s=0.5, pace_s=0.5, clockable_s=0.5)]
    assert energy_j(TWO, parts, 1.2) == pytest.approx(955.0)
    slack = lower_clocks(TWO, "dp", parts, 1.2, microbatches=1)
    assert slack.fractions == pytest.approx((1.0, 0.5))
    assert slack.step_time_s == pytest.approx(1.2)
    assert slack.saved_j == pytest.approx(131.25)
    assert slack.energy_j == pytest.approx(955.0 - 131.25)
    bounded = lower_clocks(TWO, "dp", parts, 1.2, microbatches=1, room_s=0.1)
    assert bounded.fractions == pytest.approx((1 / 1.1, 0.5))
    assert bounded.step_time_s == pytest.approx(1.3)
    assert bounded.energy_j == pytest.approx(130 + 600 / 1.1**2 + 65 + 350 * 0.5 * 0.25)


def test_pipeline_energy_counts_each_stage_and_its_bubble_idle():
    """Two stages of 2 devices, 4 micro-batches: a 0.2 s per micro-batch (all computing, 0.8 s,
    plus a 0.1 s optimizer step), b 0.1 s (0.4 s). Step (4 + 2 - 1) x 0.2 + 0.1 = 1.1 s:
        a: 2 x (100 x 1.1 + 600 x 0.9) = 1300 J;  b: 2 x (50 x 1.1 + 350 x 0.4) = 390 J.
    b runs at 0.1 / 0.2 = 0.5 of its clock at no cost in step time: 2 x 350 x 0.4 x 0.75 = 210 J
    saved; a's optimizer step is not clocked."""
    parts = [Part(group=0, devices=2, busy_s=0.9, pace_s=0.2, clockable_s=0.8),
             Part(group=1, devices=2, busy_s=0.4, pace_s=0.1, clockable_s=0.4)]
    assert energy_j(TWO, parts, 1.1) == pytest.approx(1690.0)
    slack = lower_clocks(TWO, "pipeline", parts, 1.1, microbatches=4)
    assert slack.fractions == pytest.approx((1.0, 0.5))
    assert slack.step_time_s == pytest.approx(1.1)
    assert slack.saved_j == pytest.approx(210.0)
    assert slack.energy_j == pytest.approx(1480.0)


def _fast_slow(tmp_path, *, power: bool = True) -> MixedCluster:
    """The mixed-cluster tests' groups (test_planner_mixed_cluster.py: compute rates 2:1), here
    with powers: the fast one hungrier."""
    fast, slow = tmp_path / "fast.toml", tmp_path / "slow.toml"
    watts = ("idle_w = 100\nbusy_w = 700\n", "idle_w = 50\nbusy_w = 400\n") if power else ("", "")
    fast.write_text(f'name = "fast"\n{RATES}peak_tflops = 800\nhbm_tbs = 3.2\n{watts[0]}')
    slow.write_text(f'name = "slow"\n{RATES}peak_tflops = 400\nhbm_tbs = 1.6\n{watts[1]}')
    return mixed_cluster_from_dict({"groups": [{"preset": str(fast), "nodes": 1}, {"preset": str(slow), "nodes": 1}]},
                                   source="mix")


def test_searched_dp_plan_energy_is_the_sum_over_its_ranks(tmp_path):
    """The searched uneven-dp plan (4 sequences on each fast device, 2 on each slow one): its
    energy is, over the 16 ranks, each rank's group's idle power over the plan's step plus its
    busy power above idle over the rank's busy seconds, those from the homogeneous model of its
    group at its share (cost.evaluate, called here)."""
    mixed = _fast_slow(tmp_path)
    model = model_from_name("tiny")
    best = min(dp_plans(model, mixed, 128, 48, _options), key=lambda p: p.step_time_s)
    m = best.plan.num_microbatches
    shares = parse_shares(best.plan.shares, 16, 48, m)
    expected = 0.0
    for rank, n in enumerate(shares):
        c = mixed.groups[0 if rank < 8 else 1].cluster
        mbs = math.ceil(n / m)  # a share is priced at its largest micro-batch (mixed_dp)
        est = evaluate(model, c, Workload(global_batch=16 * m * mbs, seq_len=128),
                       Layout(Plan(dp=16, microbatches=m), mbs=mbs), _options(c))
        expected += c.idle_w * best.step_time_s + (c.busy_w - c.idle_w) * busy_seconds(est)
    assert best.detail["energy_j_per_step"] == pytest.approx(expected, rel=1e-12)
    assert best.detail["energy_j_per_token"] == pytest.approx(expected / (48 * 128), rel=1e-12)
    # Busy share of each group's device-seconds, a fraction of the step.
    assert all(0 < b <= 1 for b in best.detail["busy_fraction_by_group"])


def test_one_preset_twice_prices_energy_as_the_homogeneous_plan():
    """Two groups of the same machines, equal shares: the mixed plan's energy is energy.py's
    for the homogeneous plan on 16 of them (one energy model, not a second copy)."""
    mixed = mixed_cluster_from_dict({"groups": [{"preset": "dgx-h100", "nodes": 1}, {"preset": "dgx-h100", "nodes": 1}]},
                                    source="same")
    model = model_from_name("tiny")
    one = [p for p in dp_plans(model, mixed, 128, 32, _options) if p.plan.microbatches == 1][0]
    est = evaluate(model, H100, Workload(global_batch=32, seq_len=128), Layout(Plan(dp=16, microbatches=1), mbs=2),
                   _options(H100))
    assert one.detail["energy_j_per_step"] == pytest.approx(energy_per_step_j(est, H100), rel=1e-9)
    assert one.detail["clock_energy_saved_j_per_step"] == pytest.approx(0.0, abs=1e-9)  # no rank waits on another
    prices = {"dgx-h100": 2.5}
    assert cost_usd_per_mtok(mixed, one, prices, 32 * 128) == pytest.approx(
        2.5 * 16 * one.step_time_s / 3600 / (32 * 128) * 1e6, rel=1e-12)


def _plan(step: float, parts: list[Part], name: str) -> MixedPlan:
    return MixedPlan(kind="dp", plan=Plan(dp=2, shares=name), mbs=1, step_time_s=step, baseline_s=step,
                     memory_gib=(1.0, 1.0), parts=tuple(parts))


def test_objectives_rank_hand_made_plans():
    """Two plans over TWO (one device per group). quick: 1.0 s, a busy 0.9 s, b busy 0.9 s:
        100 + 600 x 0.9 + 50 + 350 x 0.9 = 1005 J.
    lazy: 1.1 s, a busy 0.5 s, b busy 0.5 s: 110 + 300 + 55 + 175 = 640 J.
    Time and cost (a plan pays for both groups' devices for its step: $3 and $1 per GPU hour)
    rank quick first; energy ranks lazy first; within 1.05x of the fastest only quick is left."""
    quick = _plan(1.0, [Part(group=0, devices=1, busy_s=0.9, pace_s=0.9, clockable_s=0.9),
                        Part(group=1, devices=1, busy_s=0.9, pace_s=0.9, clockable_s=0.9)], "1:1")
    lazy = _plan(1.1, [Part(group=0, devices=1, busy_s=0.5, pace_s=1.0, clockable_s=0.5),
                       Part(group=1, devices=1, busy_s=0.5, pace_s=1.0, clockable_s=0.5)], "1:1")
    assert energy_j(TWO, quick.parts, 1.0) == pytest.approx(1005.0)
    assert energy_j(TWO, lazy.parts, 1.1) == pytest.approx(640.0)
    prices = {"hungry": 3.0, "frugal": 1.0}
    assert MixedObjective(kind="time").rank(TWO, [lazy, quick]) == [quick, lazy]
    assert MixedObjective(kind="energy").rank(TWO, [quick, lazy]) == [lazy, quick]
    by_cost = MixedObjective(kind="cost", prices=prices, tokens=1000)
    assert by_cost.rank(TWO, [lazy, quick]) == [quick, lazy]
    assert by_cost.value(TWO, quick) == pytest.approx(4.0 * 1.0 / 3600 / 1000 * 1e6)
    assert MixedObjective(kind="energy", max_slowdown=1.05).rank(TWO, [quick, lazy]) == [quick]


def test_a_group_without_a_price_is_one_line(tmp_path):
    mixed = _fast_slow(tmp_path)
    with pytest.raises(UserError, match=r"no price for group 'slow' \(preset 'slow'\).*--price slow=USD_PER_GPU_HOUR"):
        mixed_objective("cost", None, mixed, {"fast": 3.0}, 1)
    with pytest.raises(UserError, match="needs a price for every group's preset"):
        mixed_objective("cost", None, mixed, {}, 1)
    with pytest.raises(UserError, match="'dgx-a100', which is not a cluster being planned"):
        mixed_objective("time", None, mixed, {"fast": 3.0, "slow": 1.0, "dgx-a100": 2.0}, 1)
    with pytest.raises(UserError, match="power of the devices of group 'fast'"):
        (tmp_path / "unpowered").mkdir()
        mixed_objective("energy", None, _fast_slow(tmp_path / "unpowered", power=False), {}, 1)
    with pytest.raises(UserError, match="add --objective energy or --objective cost"):
        mixed_objective("time", 1.1, mixed, {}, 1)


def _mixed_file(tmp_path) -> str:
    _fast_slow(tmp_path)
    path = tmp_path / "mix.toml"
    path.write_text(f'name = "mix"\n[[groups]]\npreset = "{tmp_path / "fast.toml"}"\nnodes = 1\n'
                    f'[[groups]]\npreset = "{tmp_path / "slow.toml"}"\nnodes = 1\n')
    return str(path)


ARGS = ["--model", "tiny", "--gpus", "16", "--global-batch", "48", "--seq-len", "128", "--top", "4"]


def test_plan_json_gives_energy_cost_and_the_clocked_frontier(tmp_path, capsys):
    """`--json`: every plan has energy per step and token, cost from the two prices (each
    group's devices it holds at its price over the step: both groups' for a plan over them, one
    group's alone) and, ranked by energy under --max-slowdown 1, the clocked energy: exactly the
    full-clock energy less the slack clocks' saving, the step unchanged."""
    path = _mixed_file(tmp_path)
    prices = ["--price", "fast=3", "--price", "slow=1"]
    assert cli.run(["plan", "--cluster", path, *ARGS[:-1], "1000", "--json", "--objective", "cost", *prices]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objective"] == "cost"
    per_hour = {"fast": 3 * 8, "slow": 1 * 8}
    for p in out["plans"]:
        dollars = per_hour[p["group"]] if p["kind"] == "alone" else per_hour["fast"] + per_hour["slow"]
        assert p["cost_usd_per_mtok"] == pytest.approx(dollars * p["step_time_s"] / 3600 / (48 * 128) * 1e6)
        assert p["energy_j_per_token"] == pytest.approx(p["energy_j_per_step"] / (48 * 128))
    over_both = [p["step_time_s"] for p in out["plans"] if p["kind"] != "alone"]
    assert over_both and over_both == sorted(over_both)  # the same devices held: the cheapest is the fastest
    assert cli.run(["plan", "--cluster", path, *ARGS, "--json", "--objective", "energy", "--max-slowdown", "1"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    for p in plans:
        assert p["clocked_step_time_s"] == pytest.approx(p["step_time_s"], rel=1e-12)
        assert p["clocked_energy_j_per_step"] == pytest.approx(
            p["energy_j_per_step"] - p["clock_energy_saved_j_per_step"], rel=1e-12)
    clocked = [p["clocked_energy_j_per_step"] for p in plans]
    assert clocked == sorted(clocked)


def _best_alone(tmp_path, group: int):
    """The homogeneous planner's fastest plan on one group's 8 devices, called here directly."""
    mixed = _fast_slow(tmp_path)
    cluster = mixed.groups[group].cluster
    return search(model_from_name("tiny"), cluster, Workload(global_batch=48, seq_len=128), world_size=8,
                  options=_options(cluster), keep=1).ranked[0], cluster


@pytest.mark.parametrize("fast_price, chosen", [(3.0, "slow alone"), (1.0, "fast alone")])
def test_cost_takes_the_group_whose_price_makes_it_cheaper_per_token(tmp_path, capsys, fast_price, chosen):
    """Ranked by time, the plan over both groups wins (every device used, as --gpus asks).
    Ranked by cost, a group left out is not paid for: with the fast group (twice the compute
    rate) at $3 per GPU hour and the slow at $1, the slow group alone is cheapest per token
    (8 x $1 for about twice the fast group's step, against 8 x $3 for one, and 8 x $4 for the
    two together for about two thirds of one); with both at $1 the fast group alone is. The
    cost printed is the hand product price x 8 x step / 3600 / tokens x 1e6 of the homogeneous
    planner's fastest plan on that group, and less than the other two candidates'."""
    path = _mixed_file(tmp_path)
    assert cli.run(["plan", "--cluster", path, *ARGS, "--json"]) == 0
    by_time = json.loads(capsys.readouterr().out)["plans"]
    assert by_time[0]["kind"] in ("dp", "pipeline") and all(p["kind"] != "alone" for p in by_time)
    assert cli.run(["plan", "--cluster", path, *ARGS, "--json", "--objective", "cost", "--price", f"fast={fast_price}",
                    "--price", "slow=1"]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    assert f"{best['group']} {best['kind']}" == chosen
    tokens = 48 * 128
    costs = {}
    for name, g, price in (("fast", 0, fast_price), ("slow", 1, 1.0)):
        est, _ = _best_alone(tmp_path, g)
        costs[name] = price * 8 * est.step_time_s / 3600 / tokens * 1e6
    costs["both"] = (fast_price + 1.0) * 8 * by_time[0]["step_time_s"] / 3600 / tokens * 1e6
    assert best["cost_usd_per_mtok"] == pytest.approx(costs[best["group"]], rel=1e-12)
    assert best["cost_usd_per_mtok"] == pytest.approx(min(costs.values()), rel=1e-12)
    assert sorted(costs.values())[1] > sorted(costs.values())[0]


def test_a_group_alone_counts_energy_as_the_homogeneous_plan(tmp_path, capsys):
    """A group alone is the homogeneous plan on its devices: its energy is energy.py's."""
    path = _mixed_file(tmp_path)
    assert cli.run(["plan", "--cluster", path, *ARGS[:-1], "1000", "--json", "--objective", "energy"]) == 0
    alone = [p for p in json.loads(capsys.readouterr().out)["plans"] if p["kind"] == "alone"]
    for g, name in enumerate(("fast", "slow")):
        est, cluster = _best_alone(tmp_path, g)
        mine = [p for p in alone if p["group"] == name and p["fix"] == est.layout.to_string()]
        assert len(mine) == 1
        for p in mine:
            assert p["energy_j_per_step"] == pytest.approx(energy_per_step_j(est, cluster), rel=1e-12)
            assert p["busy_fraction_by_group"][g] == pytest.approx(busy_seconds(est) / est.step_time_s)
            assert p["busy_fraction_by_group"][1 - g] is None


def test_plan_table_prints_the_energy_and_cost_and_why(tmp_path, capsys):
    path = _mixed_file(tmp_path)
    assert cli.run(["plan", "--cluster", path, *ARGS, "--objective", "energy", "--price", "fast=3",
                    "--price", "slow=1"]) == 0
    out = capsys.readouterr().out
    assert "J/token" in out and "$/Mtok" in out
    assert "ranked by energy: #1 takes" in out and "its devices busy fast" in out
    assert cli.run(["plan", "--cluster", path, *ARGS, "--objective", "cost", "--price", "fast=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no price for group 'slow'" in err


def test_plan_with_prices_stays_torch_free(tmp_path):
    path = _mixed_file(tmp_path)
    code = f"""
import sys
from phalanx.cli import run
assert run(["plan", "--cluster", {path!r}, *{ARGS!r}, "--objective", "cost", "--price", "fast=3",
            "--price", "slow=1"]) == 0
assert run(["simulate", "--model", "tiny", "--cluster", {path!r}, "--global-batch", "48", "--seq-len", "128",
            "--plan", "dp=16,shares=4:4:4:4:4:4:4:4:2:2:2:2:2:2:2:2", "--price", "fast=3", "--price", "slow=1"]) == 0
assert "torch" not in sys.modules, "torch was imported"
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "predicted energy" in run.stdout and "predicted cost $" in run.stdout
