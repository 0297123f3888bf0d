"""Energy and cost of plans (planner/energy.py): the arithmetic on hand-computable steps, the
ranking by --objective and --max-slowdown, --price's errors, the JSON keys. All torch-free."""

import dataclasses
import json

import pytest

from phalanx import cli
from phalanx.errors import UserError
from phalanx.model.by_name import model_config
from phalanx.planner.cost import evaluate
from phalanx.planner.energy import (
    Objective,
    cost_usd_per_mtok,
    energy_per_step_j,
    objective_for,
    parse_prices,
    step_energy_j,
)
from phalanx.planner.hardware import PRESETS
from phalanx.planner.layout import Layout, Workload
from phalanx.plan import Plan

H100 = PRESETS["dgx-h100"]
POWERED = dataclasses.replace(H100, idle_w=100.0, busy_w=700.0)


def run_cli(capsys, *argv):
    code = cli.run(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _estimate(step_s: float, breakdown: dict[str, float], *, world: int = 8, tokens: int = 1_000_000):
    """A real Estimate with its step, breakdown, device count and tokens set by hand."""
    model = model_config("tiny")
    layout = Layout(Plan(dp=8), mbs=1)
    est = evaluate(model, H100, Workload(global_batch=8, seq_len=128), layout)
    return dataclasses.replace(est, step_time_s=step_s, breakdown=breakdown, world_size=world, tokens=tokens)


def test_energy_of_a_step_whose_busy_fraction_is_known():
    """8 GPUs, a 2 s step computing 1.5 s of it (compute 1.0 + recompute 0.25 + optimizer
    0.25; the 0.5 s of exposed dp traffic waits): 8 x (100 W x 2 s + 600 W x 1.5 s) = 8,800 J,
    which is n x (idle + (busy - idle) x frac) x step = 8 x (100 + 600 x 0.75) x 2."""
    assert step_energy_j(n_gpus=8, step_s=2.0, busy_s=1.5, idle_w=100.0, busy_w=700.0) == pytest.approx(8800.0)
    est = _estimate(2.0, {"compute": 1.0, "recompute": 0.25, "optimizer": 0.25, "dp_comm": 0.5, "bubble": 0.0})
    assert energy_per_step_j(est, POWERED) == pytest.approx(8 * (100 + 600 * 0.75) * 2)
    assert energy_per_step_j(est, PRESETS["local"]) is None  # no power figures: no energy


def test_cost_per_million_tokens():
    """$2.50 per GPU hour x 8 GPUs x 2 s / 3600 / 1e6 tokens x 1e6 = $0.01111 per Mtok."""
    est = _estimate(2.0, {"compute": 2.0})
    assert cost_usd_per_mtok(est, 2.5) == pytest.approx(2.5 * 8 * 2.0 / 3600 / 1e6 * 1e6)


def test_energy_ranks_a_slower_idler_plan_first_and_the_frontier_bounds_the_slowdown():
    """A computes for all of its 1.0 s step; B takes 1.05 s but computes 0.7 s of it. Per GPU,
    A: 100 x 1.0 + 600 x 1.0 = 700 J; B: 100 x 1.05 + 600 x 0.7 = 525 J. By time A wins, by
    energy B; within 1.04x of the fastest only A is left, within 1.1x B wins again."""
    a = _estimate(1.0, {"compute": 1.0})
    b = _estimate(1.05, {"compute": 0.7, "bubble": 0.35})
    assert Objective().rank([b, a])[0] is a
    assert Objective(kind="energy", cluster=POWERED).rank([a, b])[0] is b
    assert Objective(kind="energy", cluster=POWERED, max_slowdown=1.04).rank([a, b]) == [a]
    assert Objective(kind="energy", cluster=POWERED, max_slowdown=1.1).rank([a, b]) == [b, a]


def test_plan_by_energy_under_a_slowdown_bound_says_why(capsys):
    """llama3-8b on 8 H100s within 5% of the fastest step: every plan's clocks are lowered into
    the bound (planner/clocks.py), and the least clocked energy comes first. Among layouts alone
    (clocks fixed) dp=8 wins instead: test_planner_clocks.py holds that case."""
    args = ("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "256",
            "--seq-len", "4096", "--top", "3", "--json")
    _, out, _ = run_cli(capsys, *args)
    by_time = json.loads(out)["plans"]
    code, out, _ = run_cli(capsys, *args, "--objective", "energy", "--max-slowdown", "1.05")
    by_energy = json.loads(out)["plans"]
    assert code == 0
    assert by_energy[0]["clocked_energy_j_per_step"] < by_time[0]["energy_j_per_step"]
    assert by_energy[0]["step_time_s"] <= 1.05 * by_time[0]["step_time_s"]
    assert [p["clocked_energy_j_per_step"] for p in by_energy] == sorted(p["clocked_energy_j_per_step"] for p in by_energy)
    code, out, _ = run_cli(capsys, *args[:-1], "--objective", "energy", "--max-slowdown", "1.05")
    assert code == 0 and "ranked by energy among the plans within 1.05x" in out and "computes at" in out
    assert f"best plan: --plan {by_energy[0]['plan']}  " in out


def test_json_keys_and_their_arithmetic(capsys):
    code, out, _ = run_cli(capsys, "plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                           "--global-batch", "256", "--seq-len", "4096", "--top", "2", "--json",
                           "--price", "dgx-h100=2.5")
    assert code == 0
    data = json.loads(out)
    assert data["objective"] == "time" and data["max_slowdown"] is None and data["announced"] is False
    for plan in data["plans"]:
        step, frac, tokens = plan["step_time_s"], plan["busy_fraction"], 256 * 4096
        expected = 8 * (H100.idle_w + (H100.busy_w - H100.idle_w) * frac) * step
        assert plan["energy_j_per_step"] == pytest.approx(expected)
        assert plan["energy_j_per_token"] == pytest.approx(expected / tokens)
        assert plan["cost_usd_per_mtok"] == pytest.approx(2.5 * 8 * step / 3600 / tokens * 1e6)
    code, out, _ = run_cli(capsys, "plan", "--model", "tiny", "--gpus", "2", "--global-batch", "4", "--seq-len", "64",
                           "--top", "1", "--json")
    plan = json.loads(out)["plans"][0]
    assert code == 0 and plan["energy_j_per_step"] is None and plan["cost_usd_per_mtok"] is None  # local: no power


@pytest.mark.parametrize("price, message", [
    ("dgx-h100", "expected CLUSTER=USD_PER_GPU_HOUR"),
    ("=2", "expected CLUSTER=USD_PER_GPU_HOUR"),
    ("dgx-h100=two", "'two' is not a number"),
    ("dgx-h100=-1", "positive finite"),
    ("dgx-h100=inf", "positive finite"),
    ("dgx-a100=2", "not a cluster being planned"),
])
def test_bad_prices_are_one_line_errors(capsys, price, message):
    code, _, err = run_cli(capsys, "plan", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "8",
                           "--global-batch", "16", "--seq-len", "128", "--price", price)
    assert code == 2 and err.count("\n") == 1 and message in err


def test_a_price_given_twice_is_refused():
    with pytest.raises(UserError, match="names 'dgx-h100' twice"):
        parse_prices(["dgx-h100=2", "dgx-h100=3"])


@pytest.mark.parametrize("extra, message", [
    (("--objective", "cost"), "--objective cost needs a price for 'dgx-h100'"),
    (("--max-slowdown", "1.1"), "add --objective energy or --objective cost"),
    (("--objective", "energy", "--max-slowdown", "0.9"), "at least 1"),
    (("--objective", "energy", "--max-slowdown", "nan"), "at least 1"),
])
def test_objectives_that_cannot_be_priced_are_one_line_errors(capsys, extra, message):
    code, _, err = run_cli(capsys, "plan", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "8",
                           "--global-batch", "16", "--seq-len", "128", *extra)
    assert code == 2 and err.count("\n") == 1 and message in err


def test_energy_needs_the_clusters_power():
    with pytest.raises(UserError, match="needs the power of 'local'"):
        objective_for("energy", None, PRESETS["local"], {})


def test_cost_ranks_by_price_across_clusters(capsys):
    """On one cluster cost per token is proportional to step time; across clusters the price
    decides: the side-by-side names the cheapest."""
    code, out, _ = run_cli(capsys, "plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--cluster", "dgx-a100",
                           "--gpus", "8", "--global-batch", "256", "--seq-len", "4096", "--objective", "cost",
                           "--price", "dgx-h100=4", "--price", "dgx-a100=0.5")
    assert code == 0 and "least cost: dgx-a100" in out and "cost_usd_per_mtok" in out


def test_gpu_presets_carry_power_and_rubin_is_marked_announced(capsys):
    for name, cluster in PRESETS.items():
        if name != "local":
            assert 0 < cluster.idle_w < cluster.busy_w, name
    assert PRESETS["rubin-nvl72"].announced and not PRESETS["gb200-nvl72"].announced
    code, out, _ = run_cli(capsys, "plan", "--model", "llama3-8b", "--cluster", "rubin-nvl72", "--gpus", "8",
                           "--global-batch", "256", "--seq-len", "4096", "--top", "1")
    assert code == 0 and "announced figures, not measured" in out
    with pytest.raises(UserError, match="busy_w=100.0 must be at least idle_w=200.0"):
        dataclasses.replace(H100, idle_w=200.0, busy_w=100.0)


def test_simulate_prints_energy_and_cost(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "simulate", "--model", "tiny", "--cluster", "dgx-h100", "--global-batch", "16",
                           "--seq-len", "128", "--plan", "pp=2,dp=2", "--out", str(tmp_path / "sim"),
                           "--price", "dgx-h100=2")
    assert code == 0 and "J/token" in out and "per million tokens at $2 per GPU hour" in out
