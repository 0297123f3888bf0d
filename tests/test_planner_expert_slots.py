"""The planner with the trainer's `--expert-slots S`: S / ep slots of expert state per rank,
only the layouts the trainer runs slots in, one-line errors; hand-computed figures."""

import dataclasses
import json

import pytest

from phalanx import layout_rules as rules
from phalanx.errors import UserError
from phalanx.model.config import ModelConfig
from phalanx import cli
from phalanx.planner.cost import evaluate
from phalanx.planner.options import trainer_options
from phalanx.planner.hardware import PRESETS, Cluster
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.peak_memory import stage_params
from phalanx.planner.search import auto_plan, search

H100 = PRESETS["dgx-h100"]
# h=256, 8 SwiGLU experts of 128, top-2, 2 MoE layers.
MOE = ModelConfig(name="moe", vocab_size=1024, dim=256, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=512,
                  n_experts=8, experts_per_token=2, expert_ffn_dim=128, max_seq_len=512)
ONE_EXPERT = 3 * 256 * 128  # w1, w2, w3 of one expert


def test_expert_state_follows_the_slots_per_rank():
    """dp=4,ep=4 under DDP, fp32 trainer (weights 4, gradients 4, AdamW moments 8 bytes per
    parameter): 12 slots hold 3 per rank where 8 experts held 2, one more expert's weights,
    gradient and moments per MoE layer; activations and DDP's buckets (experts are left out of
    DDP) do not change, the routed rows being the same."""
    lay, work = Layout(dp=4, ep=4, mbs=2, microbatches=1), Workload(global_batch=8, seq_len=512)
    plain, slots = trainer_options("fp32", H100), trainer_options("fp32", H100, expert_slots=12)
    assert stage_params(MOE, lay, 2, 2, plain)[2] == 2 * 2 * ONE_EXPERT
    assert stage_params(MOE, lay, 2, 2, slots)[2] == 2 * 3 * ONE_EXPERT
    before = evaluate(MOE, H100, work, lay, plain).memory_breakdown
    after = evaluate(MOE, H100, work, lay, slots).memory_breakdown
    extra = 2 * ONE_EXPERT  # one more slot per rank in each of 2 MoE layers
    assert after["parameters"] - before["parameters"] == pytest.approx(4 * extra)
    assert after["gradients"] - before["gradients"] == pytest.approx(4 * extra)
    assert after["optimizer_state"] - before["optimizer_state"] == pytest.approx(8 * extra)
    for same in ("activations", "logits", "comm_buffers"):
        assert after[same] == before[same], same
    # S = n_experts (--rebalance-every alone) holds exactly what one slot per expert holds.
    assert evaluate(MOE, H100, work, lay, trainer_options("fp32", H100, expert_slots=8)).memory_breakdown == before


def test_the_search_keeps_the_layouts_the_trainer_runs_slots_in():
    """10 slots on 4 devices: ep=2 only (10 is no multiple of 4), no tp or pp; experts under DDP
    (zero 0) or FSDP (zero 3, the search's default levels; each slot sharded over edp=2 inside
    the slot), where without slots the search also ranks ep=1, ep=4 and tp."""
    work = Workload(global_batch=8, seq_len=512)
    free = search(MOE, H100, work, world_size=4, options=trainer_options("bf16", H100), keep=1000).ranked
    assert {e.layout.ep for e in free} == {1, 2, 4} and any(e.layout.tp > 1 for e in free)
    ranked = search(MOE, H100, work, world_size=4, options=trainer_options("bf16", H100, expert_slots=10),
                    keep=1000).ranked
    assert ranked
    for e in ranked:
        assert (e.layout.ep, e.layout.dp, e.layout.tp, e.layout.pp) == (2, 4, 1, 1)
        assert not rules.expert_slots_layout_problem(10, ep=e.layout.ep, over_tp=e.layout.ep_over_tp,
                                                     fsdp=e.layout.zero >= 2, edp=2, expert_shape=(128, 256))
    assert {e.layout.zero for e in ranked} == {0, 3}
    plan = auto_plan(MOE, world_size=4, global_batch=8, seq_len=512, cluster=H100, dtype="bf16", expert_slots=10)
    assert (plan.dp, plan.ep, plan.tp, plan.pp) == (4, 2, 1, 1)


def test_slot_state_is_sharded_over_edp_under_zero_3():
    """dp=4,ep=2,zero=3, fp32 trainer: 12 slots hold 6 per rank where 8 experts held 4, two more
    slots per MoE layer, 4 over the 2 layers. FSDP shards each slot over edp=2 (inside the slot,
    as the trainer does), so the AdamW moments grow by 8 bytes x 4 slots / 2; the weights by
    4 bytes x 4 slots / 2 sharded plus one layer's 2 slots gathered for its compute (4 bytes
    each), as zero 3 holds one unit gathered at a time."""
    lay, work = Layout(dp=4, ep=2, zero=3, mbs=2, microbatches=1), Workload(global_batch=8, seq_len=512)
    before = evaluate(MOE, H100, work, lay, trainer_options("fp32", H100)).memory_breakdown
    after = evaluate(MOE, H100, work, lay, trainer_options("fp32", H100, expert_slots=12)).memory_breakdown
    assert after["optimizer_state"] - before["optimizer_state"] == pytest.approx(8 * 4 * ONE_EXPERT / 2)
    assert after["parameters"] - before["parameters"] == pytest.approx(4 * 4 * ONE_EXPERT / 2 + 4 * 2 * ONE_EXPERT)


def test_slot_memory_decides_the_ep():
    """16 slots: ep=2 holds 8 slots per rank, ep=4 holds 4. On a device whose usable memory lies
    between the two layouts' peaks, ep=2 is pruned and the plan takes ep=4 (without slots both fit)."""
    work = Workload(global_batch=8, seq_len=512)
    options = trainer_options("fp32", H100, expert_slots=16)
    need = {ep: evaluate(MOE, H100, work, Layout(dp=4, ep=ep, mbs=2, microbatches=1), options).memory_bytes
            for ep in (2, 4)}
    assert need[2] - need[4] == pytest.approx(2 * (8 - 4) * ONE_EXPERT * 16)  # 4 slots x 2 layers x 16 bytes
    usable = (need[2] + need[4]) / 2
    small = Cluster(name="small", memory_gib=usable / 2**30 + 1.0, memory_reserved_gib=1.0)
    fixed = {"mbs": 2, "recompute": "none", "zero": 0}  # the layouts priced above (recompute or zero would fit ep=2 too)
    with_slots = search(MOE, small, work, world_size=4, fixed=fixed, options=options, keep=1000).ranked
    assert with_slots and {e.layout.ep for e in with_slots} == {4}
    without = search(MOE, small, work, world_size=4, fixed=fixed, options=trainer_options("fp32", H100), keep=1000)
    assert 2 in {e.layout.ep for e in without.ranked}


@pytest.mark.parametrize("argv, message", [
    (["--expert-slots", "4"], "error: --expert-slots=4 is fewer slots than the 8 experts of model 'moe'\n"),
    (["--expert-slots", "10", "--fix", "ep=4"],
     "error: no layout of 4 GPUs matches --fix ep=4 with --expert-slots=10: --expert-slots=10 is not a multiple "
     "of ep=4 (10 / 4 is not a whole number of slots per rank)\n"),
    (["--expert-slots", "9"], "error: no layout of 4 GPUs matches with --expert-slots=9: --expert-slots=9 is not a "
                              "multiple of any ep > 1 that divides dp=4 and n_experts=8\n"),
    (["--expert-slots", "12", "--fix", "tp=2"], "is not supported yet beside tp or pp (got tp=2, pp=1)"),
    (["--expert-slots", "12", "--any-runtime"], "error: --expert-slots plans the phalanx trainer's expert slots"),
])
def test_bad_slots_are_one_line_errors(tmp_path, capsys, argv, message):
    model = tmp_path / "moe.json"
    model.write_text(json.dumps(dataclasses.asdict(MOE)))
    code = cli.run(["plan", "--model", str(model), "--cluster", "dgx-h100", "--gpus", "4", "--global-batch", "8",
                     "--seq-len", "512", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_auto_plan_without_a_slot_layout_says_why():
    with pytest.raises(UserError, match="runs --expert-slots=9: --expert-slots=9 is not a multiple of any ep > 1"):
        auto_plan(MOE, world_size=4, global_batch=8, seq_len=512, cluster=H100, expert_slots=9)


def test_train_plan_auto_plans_for_the_runs_expert_slots():
    """`phalanx train --plan auto --expert-slots S`: the planner's layout for S, which the
    trainer's own slot checks accept. tiny-moe (8 experts) on 4 processes: 10 slots only run
    at ep=2; --rebalance-every alone plans one slot per expert, under the slots' rules. The
    run's job carries the slots its plan was chosen for."""
    from phalanx.model.by_name import model_config
    from phalanx.plan import plan_from_string
    from phalanx.train.config import TrainConfig
    from phalanx.train.expert_slot_training import slot_placements
    from phalanx.train.job import resolve_job

    def choose_auto_plan(cfg, world):
        job = resolve_job(cfg, world, None, run_dir="unused")
        assert job.expert_slots == (cfg.expert_slots or 8)
        return job.settings

    base = TrainConfig(model="tiny-moe", plan="auto", cluster="dgx-h100", device="cpu", global_batch=8, seq_len=128)
    for change, ep in ((dict(expert_slots=10), {2}), (dict(rebalance_every=2), {2, 4}), (dict(expert_slots=12), {2, 4})):
        cfg = choose_auto_plan(base.replace(**change), 4)
        plan = plan_from_string(cfg.plan, 4)
        assert plan.ep in ep, (change, cfg.plan)
        assert slot_placements(cfg, model_config("tiny-moe"), plan)  # the trainer runs it
    expected = auto_plan(model_config("tiny-moe"), world_size=4, global_batch=8, seq_len=128, cluster="dgx-h100",
                         expert_slots=10)
    assert choose_auto_plan(base.replace(expert_slots=10), 4).plan == expected.to_string()


def test_simulate_says_why_a_plan_runs_no_slots(tmp_path, capsys):
    code = cli.run(["simulate", "--model", "tiny-moe", "--cluster", "dgx-h100", "--global-batch", "8", "--seq-len",
                     "128", "--plan", "dp=4,ep=4", "--expert-slots", "10", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err == ("phalanx: error: --plan dp=4,ep=4 gives no layout with --expert-slots=10: "
                                 "--expert-slots=10 is not a multiple of ep=4 (10 / 4 is not a whole number of "
                                 "slots per rank)\n")


def test_replica_gradient_sum_is_charged_once_per_step_and_moe_layer():
    """The trainer sums replicated experts' gradients over the ep group once per optimizer step
    and MoE layer (one all-reduce of a dense buffer of the replicated experts' fp32 gradients).
    12 slots for 8 experts replicate at most 4 experts; 20 slots at most all 8."""
    from phalanx.planner import comm

    lay, work = Layout(dp=4, ep=4, mbs=2, microbatches=1), Workload(global_batch=8, seq_len=512)
    plain = evaluate(MOE, H100, work, lay, trainer_options("fp32", H100)).breakdown["dp_comm"]
    for slots, replicated in ((12, 4), (20, 8)):
        got = evaluate(MOE, H100, work, lay, trainer_options("fp32", H100, expert_slots=slots)).breakdown["dp_comm"]
        want = 2 * comm.all_reduce(H100, replicated * ONE_EXPERT * 4, size=4, stride=1)
        assert got - plain == pytest.approx(want, rel=1e-9), slots
    # S = n_experts replicates nothing: no collective.
    assert evaluate(MOE, H100, work, lay, trainer_options("fp32", H100, expert_slots=8)).breakdown["dp_comm"] == plain


def test_replica_gradient_sum_under_fsdp_sums_the_slices():
    """dp=4,ep=2,zero=3: each slot is sharded over edp=2 inside the slot, and a rank sums its
    half of the replicated experts' gradients over its ep group of 2: the all-reduce carries
    4 replicated experts x one expert x 4 bytes / 2, per MoE layer (2). (The function itself:
    under zero 3 more slots also grow FSDP's own gathers, which dp_comm charges too.)"""
    from phalanx.planner import comm
    from phalanx.planner.dp_traffic import replica_sum_time

    fsdp, ddp = Layout(dp=4, ep=2, zero=3, mbs=2, microbatches=1), Layout(dp=4, ep=2, mbs=2, microbatches=1)
    assert replica_sum_time(H100, MOE, fsdp, 12, 2) == pytest.approx(
        2 * comm.all_reduce(H100, 4 * ONE_EXPERT * 4 / 2, size=2, stride=1), rel=1e-9)
    assert replica_sum_time(H100, MOE, ddp, 12, 2) == pytest.approx(
        2 * comm.all_reduce(H100, 4 * ONE_EXPERT * 4, size=2, stride=1), rel=1e-9)


def test_slot_rules_under_fsdp():
    """FSDP shards each slot over edp inside the slot, evenly: edp must divide the experts'
    ffn_dim or dim (either will do, the trainer picks the first); DDP (fsdp=False) has no such
    rule; offload and tp/pp stay refused."""
    rule = rules.expert_slots_layout_problem
    assert not rule(12, ep=2, fsdp=True, over_tp=False, edp=2, expert_shape=(128, 256))
    assert not rule(12, ep=2, fsdp=True, over_tp=False, edp=3, expert_shape=(96, 256))  # ffn_dim divides
    assert not rule(12, ep=2, fsdp=True, over_tp=False, edp=3, expert_shape=(128, 48))  # dim divides
    assert rule(12, ep=2, fsdp=True, over_tp=False, edp=3, expert_shape=(128, 256)) == (
        "--expert-slots=12 under FSDP shards each expert slot over edp=3, which must divide the experts' "
        "ffn_dim=128 or dim=256")
    assert not rule(12, ep=2, fsdp=False, over_tp=False, edp=3, expert_shape=(128, 256))
    assert "with offload=true" in rule(12, ep=2, fsdp=True, over_tp=False, edp=2, expert_shape=(128, 256), offload=True)
    assert "beside tp or pp (got tp=1, pp=2)" in rule(12, ep=2, fsdp=True, over_tp=False, pp=2)


def test_best_plan_line_carries_the_slots(tmp_path, capsys):
    """`phalanx plan --expert-slots S` says the flags `phalanx train` needs for its best plan:
    the plan and the slots it was chosen for (not a plan key)."""
    model = tmp_path / "moe.json"
    model.write_text(json.dumps(dataclasses.asdict(MOE)))
    code = cli.run(["plan", "--model", str(model), "--cluster", "dgx-h100", "--gpus", "4", "--global-batch", "8",
                     "--seq-len", "512", "--expert-slots", "12"])
    best = [line for line in capsys.readouterr().out.splitlines() if line.startswith("best plan: ")]
    assert code == 0 and len(best) == 1 and " --expert-slots 12  (mbs=" in best[0], best
