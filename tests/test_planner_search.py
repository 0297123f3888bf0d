"""The search: --fix, divisibility, the JSON contract, the what-if, speed, auto_plan."""

import json

import pytest

from phalanx.errors import UserError
from phalanx.model.by_name import model_config
from phalanx.model.config import ModelConfig
from phalanx.plan import Plan
from phalanx import cli
from phalanx.planner.hardware import PRESETS
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.search import auto_plan, parse_fix, search

H100 = PRESETS["dgx-h100"]


def run_cli(capsys, *argv):
    code = cli.run(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_layout_is_the_plan_plus_mbs_and_the_planner_only_zero1():
    lay = Layout(dp=4, tp=2, microbatches=8, mbs=2, zero=1)  # the flat spelling
    assert lay == Layout(Plan(dp=4, tp=2, microbatches=8), mbs=2, zero1=True)
    assert (lay.dp, lay.tp, lay.world_size, lay.zero, lay.plan.zero) == (4, 2, 8, 1, 0)  # the trainer runs zero=0
    assert lay.replace(zero=3).plan.zero == 3 and lay.replace(zero=3).zero == 3
    assert lay.replace(recompute="full").zero == 1 and lay.replace(recompute="full").plan.recompute == "full"
    assert parse_fix(lay.to_string()) == {"dp": 4, "tp": 2, "microbatches": 8, "mbs": 2, "zero": 1}
    assert Layout(dp=2).microbatches == 1  # not the trainer's "pick a default" 0
    with pytest.raises(UserError, match="contradicts the plan's zero=3"):
        Layout(Plan(dp=2, zero=3), zero1=True)


def test_parse_fix_maps_fsdp_and_mbs():
    assert parse_fix("tp=8,pp=4,mbs=2") == {"tp": 8, "pp": 4, "mbs": 2}
    assert parse_fix("fsdp=true,schedule=zbv") == {"zero": 3, "schedule": "zbv"}
    with pytest.raises(UserError, match="contradicts"):
        parse_fix("fsdp=true,zero=1")
    assert parse_fix("cp=2,dp=4") == {"cp": 2, "dp": 4}
    with pytest.raises(UserError, match="unknown plan key 'xp'"):
        parse_fix("xp=2")


def test_fix_pins_knobs_and_searches_the_rest():
    work = Workload(global_batch=1024, seq_len=4096)
    result = search(model_config("llama3-70b"), H100, work, world_size=64, fixed={"tp": 8, "pp": 4, "mbs": 1})
    assert result.ranked
    for est in result.ranked:
        assert (est.layout.tp, est.layout.pp, est.layout.mbs, est.layout.dp) == (8, 4, 1, 2)
    assert result.ranked == sorted(result.ranked, key=lambda e: e.step_time_s)


def test_global_batch_divisibility_is_honoured():
    work = Workload(global_batch=6, seq_len=128)
    result = search(model_config("tiny"), PRESETS["local"], work, world_size=4, keep=1000)
    assert result.ranked
    assert {e.layout.dp for e in result.ranked} <= {1, 2}  # dp=4 does not divide 6
    for e in result.ranked:
        assert e.layout.dp * e.layout.mbs * e.layout.microbatches == 6


def test_auto_plan_returns_a_runnable_plan():
    plan = auto_plan(model_config("tiny"), world_size=4, global_batch=8, seq_len=64, cluster=PRESETS["local"])
    assert isinstance(plan, Plan)
    plan.validate(4)
    assert plan.world_size == 4 and 8 % plan.dp == 0
    dp_only = auto_plan(model_config("tiny"), world_size=4, global_batch=8, seq_len=64, cluster=PRESETS["local"],
                        fixed={"tp": 1, "pp": 1})
    assert (dp_only.dp, dp_only.tp, dp_only.pp) == (4, 1, 1)
    # 64 ranks: tp <= 4 (heads) and pp <= 4 (layers) leave dp >= 4, which never divides 7.
    with pytest.raises(UserError, match="divides global batch 7"):
        auto_plan(model_config("tiny"), world_size=64, global_batch=7, seq_len=64, cluster=H100)


def test_json_output_keeps_its_names(capsys):
    code, out, _ = run_cli(capsys, "plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64",
                           "--global-batch", "1024", "--seq-len", "4096", "--json", "--top", "3")
    assert code == 0
    data = json.loads(out)
    assert len(data["plans"]) == 3 and data["pruned_memory"] > 0
    for key in ("dp", "tp", "pp", "ep", "mbs", "microbatches", "schedule", "virtual", "recompute", "fsdp",
                "zero", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_gib_per_gpu", "breakdown"):
        assert key in data["plans"][0], key
    first = data["plans"][0]
    assert sum(first["breakdown"].values()) == pytest.approx(first["step_time_s"])
    assert first["step_time_s"] <= data["plans"][1]["step_time_s"]


def test_table_and_what_if(capsys):
    code, out, _ = run_cli(capsys, "plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64",
                           "--global-batch", "1024", "--seq-len", "4096", "--fix", "tp=8,pp=4")
    assert code == 0 and "pruned for memory" in out and "best plan: --plan" in out
    code, out, _ = run_cli(capsys, "plan", "--model", "llama3-405b", "--cluster", "gb200-nvl72", "--cluster",
                           "dgx-h100", "--gpus", "1152", "--global-batch", "1152", "--seq-len", "8192")
    assert code == 0 and "gb200-nvl72" in out and "dgx-h100" in out and "tflops_per_gpu" in out


def test_bad_input_is_a_one_line_error(capsys):
    code, _, err = run_cli(capsys, "plan", "--model", "tiny", "--gpus", "4", "--global-batch", "8",
                           "--seq-len", "64", "--fix", "tp=3")
    assert code == 2 and err.count("\n") == 1 and "no layout of 4 GPUs matches --fix tp=3" in err


def test_trillion_parameters_on_3072_gpus_finds_plans():
    model = ModelConfig(name="1t", vocab_size=131072, dim=25600, n_layers=128, n_heads=160, n_kv_heads=160,
                        ffn_dim=102400, mlp="gelu")
    result = search(model, H100, Workload(global_batch=3072, seq_len=4096), world_size=3072)
    # Its wall time is benchmarks/planner_speed.py's (no timed tests): here, that it finds plans.
    assert result.ranked and result.considered > 1000


def test_trainer_rules_for_schedules_and_tp():
    # DualPipe needs two micro-batches per stage; interleaved rounds of about pp must split evenly.
    from phalanx.planner.search import SearchSpace, _schedules

    names = lambda pp, m: {s for s, _ in _schedules(SearchSpace(), pp, m, 32)}  # noqa: E731
    assert "dualpipev" not in names(4, 6) and "dualpipev" in names(4, 8)
    assert "interleaved" not in names(2, 7) and "interleaved" in names(2, 8)
    # llama3-8b has 8 KV heads: tp=16 could only run with KV replication, which the trainer lacks.
    model = ModelConfig(name="kv2", vocab_size=1000, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=512)
    work = Workload(global_batch=8, seq_len=64)
    ours = search(model, H100, work, world_size=8, keep=10_000)
    anywhere = search(model, H100, work, world_size=8, keep=10_000, space=SearchSpace(phalanx_trainer=False))
    assert max(e.layout.tp for e in ours.ranked) == 2  # divides n_kv_heads=2 and vocab 1000
    assert max(e.layout.tp for e in anywhere.ranked) == 8


def test_search_recomputes_the_fewest_layers_that_fit():
    """Between none (too big) and full (fits), the search adds the fewest checkpointed blocks
    per chunk that fit; memory and recompute time scale with their share."""
    import dataclasses

    from phalanx.planner.cost import evaluate
    from phalanx.planner.layout import Layout

    model, work = model_config("llama3-8b"), Workload(global_batch=8, seq_len=8192)
    lay = Layout(dp=1, tp=8, sp=True, mbs=1, microbatches=8)
    full, none = (evaluate(model, H100, work, lay.replace(recompute=rc)) for rc in ("full", "none"))
    half = evaluate(model, H100, work, lay.replace(recompute="full", recompute_layers=16))  # 16 of 32 layers
    assert half.breakdown["recompute"] == pytest.approx(full.breakdown["recompute"] / 2)
    act = lambda e: e.memory_breakdown["activations"]  # noqa: E731
    # Half the layers keep everything, half only their input; both recompute modes hold one
    # re-run layer's activations (act(none) / 32) while it runs backward.
    assert act(half) == pytest.approx((act(full) - act(none) / 32 + act(none)) / 2 + act(none) / 32)
    # A device between the two: none does not fit, full does, so does some share in between.
    usable = (none.memory_bytes + full.memory_bytes) / 2
    small = dataclasses.replace(H100, memory_gib=usable / 2**30 + H100.memory_reserved_gib)
    found = search(model, small, work, world_size=8, fixed={"tp": 8, "mbs": 1}, keep=100).ranked
    partial = [e for e in found if e.layout.recompute_layers]
    assert partial and all(e.fits for e in partial)
    best = min(partial, key=lambda e: e.layout.recompute_layers)
    assert 0 < best.layout.recompute_layers < 32
    one_fewer = evaluate(model, small, work, best.layout.replace(recompute_layers=best.layout.recompute_layers - 1))
    assert not one_fewer.fits
    assert found[0].layout.recompute_layers  # faster than recomputing every layer


def test_plan_and_simulate_import_no_torch(tmp_path):
    """`phalanx plan` and `phalanx simulate` run in a fresh interpreter without loading torch
    (planning a 400B model runs on a laptop; torch's import is most of a plan's wall time)."""
    import subprocess
    import sys

    code = f"""
import sys
from phalanx.cli import main
for argv in (["plan", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "16",
              "--seq-len", "128", "--top", "1", "--json"],
             ["plan", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "16",
              "--seq-len", "128", "--top", "2", "--objective", "energy", "--max-slowdown", "1.1",
              "--price", "dgx-h100=2"],
             ["plan", "--model", "tiny-moe", "--cluster", "dgx-h100", "--gpus", "4", "--global-batch", "8",
              "--seq-len", "128", "--top", "1", "--expert-slots", "12"],
             ["simulate", "--model", "tiny", "--cluster", "dgx-h100", "--global-batch", "16", "--seq-len", "128",
              "--plan", "pp=2,dp=2", "--out", {str(tmp_path)!r}]):
    try:
        main(argv)
    except SystemExit as exit:
        assert exit.code == 0, (argv[0], exit.code)
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("ok")


def test_plan_piped_into_head_ends_quietly():
    """`phalanx plan ... | head -2`: the reader closes the pipe early; no BrokenPipeError
    traceback, status 0."""
    import subprocess
    import sys

    plan = subprocess.Popen([sys.executable, "-m", "phalanx", "plan", "--model", "llama3-70b", "--cluster", "dgx-h100",
                             "--gpus", "64", "--global-batch", "1024", "--seq-len", "4096"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    plan.stdout.readline()
    plan.stdout.close()  # as head does after its lines
    _, err = plan.communicate(timeout=120)
    assert plan.returncode == 0 and b"Traceback" not in err, err.decode()[-2000:]


def test_adversarial_plan_inputs_are_one_line_errors(capsys, tmp_path):
    import json

    model = tmp_path / "m.json"
    model.write_text(json.dumps({"n_layers": 0, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                                 "vocab_size": 256}))
    for argv, message in (
            (("--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "7"), "7 GPUs on 'dgx-h100' (8 per node)"),
            (("--model", str(model), "--cluster", "dgx-h100", "--gpus", "8"), "n_layers=0 must be at least 1"),
            (("--model", "tiny", "--cluster", "dgx-h100", "--gpus", "8", "--fix", "tp=3"),
             "tp=3 x pp=1 = 3 does not divide 8 GPUs")):
        code, _, err = run_cli(capsys, "plan", *argv, "--global-batch", "64", "--seq-len", "128")
        assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_rejected_fix_shows_its_memory_and_what_fits(capsys):
    code, _, err = run_cli(capsys, "plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                           "--global-batch", "64", "--seq-len", "2048", "--fix", "dp=8,recompute=full,mbs=1,zero=0")
    assert code == 1
    assert "dp=8,microbatches=8,recompute=full,mbs=1,zero=0 on dgx-h100 needs" in err and "optimizer_state" in err
    assert "fits with" in err and "zero=3" in err


def test_every_row_has_a_step_time_band(capsys):
    import json

    from phalanx.planner.validation import figures

    code, out, _ = run_cli(capsys, "plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                           "--global-batch", "64", "--seq-len", "2048", "--json", "--top", "2")
    plans = json.loads(out)["plans"]
    assert code == 0 and all(p["step_time_band"] == figures()["published"]["median_abs_error"] for p in plans)
    code, out, _ = run_cli(capsys, "plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                           "--global-batch", "64", "--seq-len", "2048", "--top", "1")
    assert f"±{figures()['published']['median_abs_error']:.0%}" in out


def test_train_plan_auto_plans_for_a_named_cluster():
    from phalanx.model.by_name import model_config
    from phalanx.train.config import TrainConfig
    from phalanx.train.world_change import auto_plan_for

    cfg = TrainConfig(model="llama3-8b", plan="auto", cluster="dgx-h100", device="cpu", global_batch=64, seq_len=2048)
    chosen = auto_plan_for(cfg, 8, model_config(cfg.model)).to_string()
    # The plan the planner ranks first for that cluster, not for this CPU.
    expected = auto_plan(model_config("llama3-8b"), world_size=8, global_batch=64, seq_len=2048, cluster="dgx-h100")
    assert chosen == expected.to_string()


def test_pruning_by_memory_and_bounds_changes_no_answer():
    # The search prices only what fits and finds the fastest rejected layout by branch and
    # bound; priced one by one, every candidate gives the same winner, the same fastest
    # rejected layout, the same counts, and no step below its lower bound.
    from phalanx.planner.cost import Options, evaluate, step_time_lower_bound
    from phalanx.planner.search import SearchSpace, candidates

    model, work = model_config("llama3-70b"), Workload(global_batch=256, seq_len=4096)
    space = SearchSpace(zero_levels=(0, 1, 2, 3))
    result = search(model, H100, work, world_size=64, space=space, keep=1000)
    every = [evaluate(model, H100, work, lay) for lay in
             candidates(model, H100, work, world_size=64, fixed={}, space=without_selective(space))]
    fits = [e for e in every if e.fits]
    rejected = [e for e in every if not e.fits]
    assert result.pruned_memory == len(rejected) > 0 and fits
    assert result.ranked[0].step_time_s == min(e.step_time_s for e in result.ranked)
    assert min(e.step_time_s for e in fits) >= result.ranked[0].step_time_s * (1 - 1e-12)
    fastest_rejected = min(rejected, key=lambda e: e.step_time_s)
    if fastest_rejected.step_time_s < result.ranked[0].step_time_s:
        assert result.fastest_pruned.step_time_s == pytest.approx(fastest_rejected.step_time_s, rel=1e-12)
    else:
        assert result.fastest_pruned is None
    for est in every:
        assert step_time_lower_bound(model, H100, work, est.layout, Options()) <= est.step_time_s * (1 + 1e-12)


def without_selective(space):
    """The search leaves selective recompute out when flash attention makes it pointless."""
    import dataclasses

    return dataclasses.replace(space, recompute=tuple(r for r in space.recompute if r != "selective"))


def test_trainer_plans_offer_zero_3_under_pp_only_as_zero_2():
    """The phalanx trainer keeps the weights gathered through backward under pp whatever the
    zero level (parallel/data_parallel.py), so zero 3 there is zero 2 by another name: the
    search lists it once, as zero 2; without pp both levels stay."""
    from phalanx.planner.search import SearchSpace, candidates

    model = model_config("llama3-8b")
    levels = {(lay.plan.pp > 1, lay.plan.zero) for lay in candidates(
        model, H100, Workload(global_batch=16, seq_len=2048), world_size=16, fixed={},
        space=SearchSpace(zero_levels=(0, 2, 3)))}
    assert (True, 2) in levels and (True, 3) not in levels
    assert (False, 2) in levels and (False, 3) in levels
