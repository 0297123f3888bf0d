"""Mixed clusters in the planner (issue 40 item 3): groups of different machines in one cluster
file; uneven data-parallel shares and pipeline splits over the groups; the `phalanx train`
command it prints runs, with the plan's `shares=`.

The hand-computable cases use two group files identical but for the compute rates (peak
FLOP/s and memory bandwidth) halved in one, on GPU presets' terms (no per-layer framework
costs, no wave quantization): every term of a device's time but the gradient all-reduce is a
rate, so the fast group's device takes exactly half the slow one's time for the same work: its
measured speed is exactly twice, the speed-proportional shares twice the slow one's, and a
pipeline over the groups gets the cut `adapt_policy.weighted_layer_counts` gives for stage
speeds 2:1. (The min-max shares may give the fast device more than twice: its optimizer step,
paid whatever its share, is half the slow one's too. At the sizes below compute outweighs it
and twice is also the min-max.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from phalanx.adapt_policy import stage_costs, weighted_layer_counts
from phalanx.errors import UserError
from phalanx.plan import Plan, parse_shares, plan_from_string
from phalanx.plan_model_checks import validate_for_model
from phalanx.planner.cost import evaluate
from phalanx.planner.hardware import PRESETS
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.mixed_cluster import load_mixed_cluster, mixed_cluster_from_dict
from phalanx.planner.mixed_dp import dp_plans
from phalanx.planner.mixed_pipeline import pipeline_plans, unit_costs
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.options import trainer_options

RATES = "devices_per_node = 8\nfast_domain = 8\nmemory_gib = 80\n"


def _groups(tmp_path: Path) -> tuple[str, str]:
    fast, slow = tmp_path / "fast.toml", tmp_path / "slow.toml"
    fast.write_text(f'name = "fast"\n{RATES}peak_tflops = 800\nhbm_tbs = 3.2\n')
    slow.write_text(f'name = "slow"\n{RATES}peak_tflops = 400\nhbm_tbs = 1.6\n')
    return str(fast), str(slow)


def _options(cluster):
    return trainer_options("bf16", cluster)


def test_a_group_twice_as_fast_gets_twice_the_share(tmp_path):
    fast, slow = _groups(tmp_path)
    mixed = mixed_cluster_from_dict({"groups": [{"preset": fast, "nodes": 1}, {"preset": slow, "nodes": 1}]},
                                    source="mix")
    model = model_from_name("tiny")
    plans = dp_plans(model, mixed, 128, 48, _options)  # 16 devices, 3 sequences each when equal
    best = min(plans, key=lambda p: p.step_time_s)
    shares = parse_shares(best.plan.shares, 16, 48, best.plan.num_microbatches)
    validate_for_model(plan_from_string(best.plan.to_string(), 16), model, global_batch=48, seq_len=128)
    assert shares == (4,) * 8 + (2,) * 8, shares
    speeds = best.detail["speeds_seq_per_s"]
    assert speeds[0] == pytest.approx(2 * speeds[1], rel=1e-9)
    # Both groups now take the slow group's time for 2 sequences: the step is that plus the
    # all-reduce, and the equal shares' step is the slow group's time for 3.
    slow_cluster = mixed.groups[1].cluster

    def compute(n: int) -> float:
        est = evaluate(model, slow_cluster, Workload(global_batch=16 * n, seq_len=128),
                       Layout(Plan(dp=16, microbatches=best.plan.num_microbatches), mbs=n), _options(slow_cluster))
        return est.step_time_s - est.breakdown["dp_comm"]

    dp_comm = best.detail["dp_comm_s"]
    assert best.step_time_s == pytest.approx(compute(2) + dp_comm, rel=1e-9)
    assert best.detail["priced_s"]["equal"] > compute(3)  # plus its own all-reduce


def test_one_preset_twice_is_the_homogeneous_plan(tmp_path):
    """Two groups of the same machines and no slower link between them: equal shares, and the
    step the homogeneous cost model gives 16 GPUs of that preset."""
    mixed = mixed_cluster_from_dict({"groups": [{"preset": "dgx-h100", "nodes": 1}, {"preset": "dgx-h100", "nodes": 1}]},
                                    source="same")
    model = model_from_name("tiny")
    plans = dp_plans(model, mixed, 128, 32, _options)
    one = [p for p in plans if p.plan.microbatches == 1][0]
    assert set(parse_shares(one.plan.shares, 16, 32)) == {2}
    cluster = PRESETS["dgx-h100"]
    est = evaluate(model, cluster, Workload(global_batch=32, seq_len=128), Layout(Plan(dp=16, microbatches=1), mbs=2),
                   _options(cluster))
    assert one.step_time_s == pytest.approx(est.step_time_s, rel=1e-9)
    assert one.gain == pytest.approx(1.0)


def test_a_pipeline_over_groups_gives_the_fast_stage_the_layers(tmp_path):
    fast, slow = _groups(tmp_path)
    mixed = mixed_cluster_from_dict({"groups": [{"preset": fast, "nodes": 1}, {"preset": slow, "nodes": 1}]},
                                    source="mix")
    model = model_from_name("small")
    plans = pipeline_plans(model, mixed, 256, 64, _options, zero_levels=(0,))
    assert plans
    for p in plans:
        # What `phalanx train --plan` checks before any worker starts: the printed plan runs.
        validate_for_model(plan_from_string(p.plan.to_string(), 16), model, global_batch=64, seq_len=256)
        assert p.detail["stage_groups"] == [0, 1] or p.detail["stage_groups"] == [0] * (p.plan.pp // 2) + [1] * (p.plan.pp // 2)
        scales = p.detail["seconds_per_tflop_by_group"]
        split = [int(x) for x in p.plan.split.split(":")]
        costs = unit_costs(model, 256)
        stage_scale = [1.0 if g == 0 else 2.0 for g in p.detail["stage_groups"]]
        assert split == weighted_layer_counts(costs, stage_scale)  # rates exactly 2:1
        assert scales[1] == pytest.approx(2 * scales[0], rel=1e-9)
        even = [int(x) for x in p.detail["even_split"].split(":")]
        assert p.step_time_s < p.baseline_s  # the even split waits on the slow stage
        fast_layers = sum(c for c, g in zip(split, p.detail["stage_groups"]) if g == 0)
        assert fast_layers > sum(c for c, g in zip(even, p.detail["stage_groups"]) if g == 0)
        times = p.detail["stage_ms_per_microbatch"]
        worst = max(times)
        # Balanced to within one layer's time on the slow group.
        layer = costs[1] * p.mbs * 2.0 * scales[0] * 1e-12 * 1e3
        assert worst - min(t for t, c in zip(times, stage_costs(costs, split))) <= layer * 1.01 + 1e-9


def test_plan_prints_a_train_command_and_json_without_torch(tmp_path):
    fast, slow = _groups(tmp_path)
    path = tmp_path / "mix.toml"
    path.write_text(f'name = "mix"\n[[groups]]\npreset = "{fast}"\nnodes = 1\n[[groups]]\npreset = "{slow}"\nnodes = 1\n')
    code = f"""
import sys
from phalanx.cli import main
for argv in (["plan", "--model", "tiny", "--cluster", {str(path)!r}, "--gpus", "16", "--global-batch", "48",
              "--seq-len", "128", "--top", "3"],
             ["plan", "--model", "tiny", "--cluster", {str(path)!r}, "--gpus", "16", "--global-batch", "48",
              "--seq-len", "128", "--json"],
             ["simulate", "--model", "tiny", "--cluster", {str(path)!r}, "--global-batch", "48", "--seq-len", "128",
              "--plan", "dp=16,shares=4:4:4:4:4:4:4:4:2:2:2:2:2:2:2:2"],
             ["simulate", "--model", "tiny", "--cluster", {str(path)!r}, "--global-batch", "48", "--seq-len", "128",
              "--plan", "dp=8,pp=2,microbatches=2"]):
    try:
        main(argv)
    except SystemExit as exit:
        assert exit.code == 0, (argv[0], exit.code)
assert "torch" not in sys.modules, "torch was imported"
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "phalanx train --model tiny --global-batch 48 --seq-len 128 --nnodes 2 --nproc 8" in out
    assert "shares=4:4:4:4:4:4:4:4:2:2:2:2:2:2:2:2" in out and "why: dp layout" in out
    assert "torchrun --nnodes 2 --nproc-per-node 8 --node-rank r --master-addr HOST --master-port PORT -m phalanx train" in out
    start = out.index("{")
    record = json.JSONDecoder().raw_decode(out[start:])[0]
    assert record["plans"][0]["kind"] == "dp" and record["groups"][0]["devices"] == 8
    assert "cost model step" in out and "slowest rank 8 (group slow)" in out
    assert "stage 0: fast, stage 1: slow" in out and "with the even split" in out


@pytest.mark.parametrize("data, message", [
    ({"groups": [{"preset": "dgx-h100"}]}, "needs both preset"),
    ({"groups": [{"preset": "dgx-z9", "nodes": 1}]}, "unknown cluster 'dgx-z9'"),
    ({"groups": [{"preset": "dgx-h100", "nodes": 0}]}, "nodes must be a whole number"),
    ({"groups": [{"preset": "dgx-h100", "nodes": 1, "gpus": 8}]}, "unknown key 'gpus'"),
    ({"groups": []}, "non-empty list"),
    ({"groups": ["dgx-h100"]}, "must be a table"),
    ({"groups": [{"preset": "dgx-h100", "nodes": 1}], "peak_tflops": 5}, "unknown mixed-cluster key 'peak_tflops'"),
    ({"groups": [{"preset": "dgx-h100", "nodes": 1}], "between_bw_gbs": -1}, "between_bw_gbs must be"),
    ({"groups": [{"preset": "local", "nodes": 1}]}, "cannot be a group"),
])
def test_bad_mixed_cluster_files_say_what_is_wrong(data, message):
    with pytest.raises(UserError, match=message):
        mixed_cluster_from_dict(data, source="bad.toml")


def test_simulate_refuses_a_pipeline_that_splits_a_stage_over_groups(tmp_path):
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"groups": [{"preset": "dgx-h100", "nodes": 1}, {"preset": "dgx-a100", "nodes": 2}]}))
    run = subprocess.run([sys.executable, "-m", "phalanx", "simulate", "--model", "tiny", "--cluster", str(path),
                          "--global-batch", "48", "--seq-len", "128", "--plan", "dp=12,pp=2"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "holds whole stages" in run.stderr, run.stderr


def test_a_mixed_file_on_the_command_line_checks_gpus(tmp_path):
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"groups": [{"preset": "dgx-h100", "nodes": 1}, {"preset": "dgx-a100", "nodes": 2}]}))
    assert load_mixed_cluster(path).devices == 24
    run = subprocess.run([sys.executable, "-m", "phalanx", "plan", "--model", "tiny", "--cluster", str(path),
                          "--gpus", "16", "--global-batch", "48", "--seq-len", "128"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "has 24 devices" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_shares_in_a_plan_are_checked():
    from phalanx.planner.search import parse_fix

    with pytest.raises(UserError, match="planned for mixed cluster files"):
        parse_fix("dp=2,shares=1:1")
    assert plan_from_string("dp=2,shares=6:2").shares == "6:2"
    with pytest.raises(UserError, match="gives 3 data-parallel ranks, but dp=2"):
        plan_from_string("dp=2,shares=3:3:2")
    with pytest.raises(UserError, match="adds up to 7 sequences, but the global batch has 8"):
        parse_shares("5:2", 2, 8)
    with pytest.raises(UserError, match="at least microbatches=2"):
        parse_shares("7:1", 2, 8, 2)


def test_train_plan_auto_on_a_mixed_cluster_starts_from_its_shares(tiny_config, tmp_path):
    """`phalanx train --plan auto --cluster MIXED_FILE` on 2 processes, one device per group
    (groups of one-device machines, the fast one twice the slow one's rates): the job starts
    from the planner's shares. At least twice as many sequences on the fast rank: its compute
    per sequence is half, and its optimizer step (the same bytes at twice the bandwidth, paid
    whatever the share) half too, so the min-max may give it more than twice."""
    from phalanx.train.job import resolve_job

    fast, slow = tmp_path / "fast1.toml", tmp_path / "slow1.toml"
    fast.write_text('name = "fast"\ndevices_per_node = 1\nfast_domain = 1\npeak_tflops = 800\nhbm_tbs = 3.2\n')
    slow.write_text('name = "slow"\ndevices_per_node = 1\nfast_domain = 1\npeak_tflops = 400\nhbm_tbs = 1.6\n')
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"groups": [{"preset": str(fast), "nodes": 1}, {"preset": str(slow), "nodes": 1}]}))
    cfg = tiny_config.replace(plan="auto", cluster=str(path), global_batch=12)
    job = resolve_job(cfg, 2, None, run_dir=cfg.out)
    assert job.plan.dp == 2 and job.shares == parse_shares(job.plan.shares, 2, 12), (job.plan, job.shares)
    assert job.shares[0] >= 2 * job.shares[1], job.shares
    with pytest.raises(UserError, match="3 processes, but the mixed cluster has 2 devices"):
        resolve_job(cfg, 3, None, run_dir=cfg.out)


def test_a_changed_world_drops_shares_given_for_the_old_ranks():
    from phalanx.train.world_change import dp_follows

    assert dp_follows(plan_from_string("dp=2,shares=6:2"), 4, 8).shares == ""
    assert dp_follows(plan_from_string("dp=2,shares=6:2"), 2, 8).shares == "6:2"


def test_a_job_takes_the_plans_shares_and_refuses_them_where_they_do_not_run(tiny_config):
    from phalanx.train.job import resolve_job

    job = resolve_job(tiny_config.replace(plan="dp=2,shares=6:2"), 2, None, run_dir=tiny_config.out)
    assert job.shares == (6, 2) and job.adapt is not None
    kept = resolve_job(tiny_config.replace(plan="dp=2,shares=6:2", adapt=False), 2, None, run_dir=tiny_config.out)
    assert kept.shares == (6, 2) and kept.adapt is None
    with pytest.raises(UserError, match="not run with this layout"):
        resolve_job(tiny_config.replace(plan="dp=2,zero=3,shares=6:2"), 2, None, run_dir=tiny_config.out)


def _train(cfg, plans):
    import torch.distributed as dist

    from phalanx.testing.weights import gathered_weights
    from phalanx.train.loop import train
    from phalanx.train.resume_point import agreed_job
    from phalanx.train.train_step import batch_rows

    out = {}
    for plan in plans:
        run_dir = Path(cfg.out) / (plan.replace(",", "_").replace("=", "-").replace(":", ".") or "one")
        job = agreed_job(cfg.replace(plan=plan, adapt=False, out=str(run_dir)), run_dir)
        result = train(job, run_dir)
        # The rows this rank read, as the step works them out (no governor: --no-adapt).
        rows = batch_rows(SimpleNamespace(governor=None, job=job, batch_rank=dist.get_rank())) if plan else None
        out[plan] = (result.losses, gathered_weights(result.model), rows)
    return out


def test_the_planned_shares_train_as_one_process(tiny_config):
    """The plan a mixed cluster gets (uneven shares, kept with --no-adapt) computes what one
    process computes (1e-4: tests/test_adapt_training.py's bound and reasons), and each rank
    reads its share's rows."""
    import torch

    from phalanx.testing.fork_ranks import run_ranks

    cfg = tiny_config.replace(steps=3)
    ref_losses, ref_weights, _ = run_ranks(1, _train, cfg, [""])[0][""]
    results = run_ranks(2, _train, cfg, ["dp=2,shares=6:2"], timeout_s=300)
    for rank, rank_results in enumerate(results):
        losses, weights, rows = rank_results["dp=2,shares=6:2"]
        assert rows == [(0, 6), (6, 8)][rank]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-4
        for name, value in weights.items():
            torch.testing.assert_close(value, ref_weights[name], atol=1e-4, rtol=1e-4, msg=name)
