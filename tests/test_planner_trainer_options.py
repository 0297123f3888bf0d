"""Planning for a phalanx training run: the trainer's precision and memory (`trainer_options`),
MoE blocks left whole on every tp rank, ep searched with tp; hand-computed figures."""

import json

import pytest

from phalanx.model.config import ModelConfig
from phalanx import cli
from phalanx.planner import comm
from phalanx.planner.cost import evaluate
from phalanx.planner.options import Options, trainer_options
from phalanx.planner.hardware import PRESETS
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.memory import layer_activation_bytes
from phalanx.planner.peak_memory import stage_params
from phalanx.planner.search import auto_plan, search

H100 = PRESETS["dgx-h100"]
# h=256, SwiGLU experts of 128, 8 experts top-2, 2 MoE layers; 8 heads, 8 KV heads.
MOE = ModelConfig(name="moe", vocab_size=1024, dim=256, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=512,
                  n_experts=8, experts_per_token=2, expert_ffn_dim=128, max_seq_len=512)
DENSE = ModelConfig(name="dense", vocab_size=1000, dim=128, n_layers=3, n_heads=4, n_kv_heads=4, ffn_dim=512,
                    mlp="gelu", max_seq_len=256)


def test_experts_are_whole_on_every_tp_rank_in_the_trainer():
    lay = Layout(dp=4, tp=2, ep=2, mbs=1, microbatches=1)
    n_moe = sum(MOE.is_moe_layer(i) for i in range(MOE.n_layers))
    assert n_moe == 2
    experts_per_layer = 8 * 3 * 256 * 128  # 8 SwiGLU experts of 256 x 128
    router = 256 * 8
    # attention 4 h^2 and two norms over tp; embedding and untied output head over tp (pp=1)
    attention_and_heads = 2 * (4 * 256 * 256 + 2 * 256) / 2 + 2 * 1024 * 256 / 2
    _, shared, experts = stage_params(MOE, lay, 2, n_moe, Options(tp_splits_experts=False))
    assert experts == 2 * experts_per_layer / 2  # over ep only
    assert shared == attention_and_heads + 2 * router  # the router is whole too
    _, shared, experts = stage_params(MOE, lay, 2, n_moe, Options(tp_splits_experts=True))
    assert experts == 2 * experts_per_layer / (2 * 2)  # Megatron: over tp x ep
    assert shared == attention_and_heads + 2 * router / 2


def test_moe_block_activations_are_not_divided_by_tp_in_the_trainer():
    s, b, h, k, f = 512, 2, 256, 2, 128
    kw = dict(seq=s, mbs=b, sp=False, recompute="none", moe=True, phalanx_model=True)
    # dispatch in, 8 s b k f inside the SwiGLU experts, combine out
    block = 2 * s * b * k * h + 8 * s * b * k * f + 2 * s * b * k * h
    whole = layer_activation_bytes(MOE, tp=2, tp_splits_experts=False, **kw)
    split = layer_activation_bytes(MOE, tp=2, tp_splits_experts=True, **kw)
    assert whole - split == pytest.approx(block / 2)
    one = layer_activation_bytes(MOE, tp=1, tp_splits_experts=False, **kw)
    assert one == layer_activation_bytes(MOE, tp=1, tp_splits_experts=True, **kw)


def test_the_search_offers_ep_with_tp_for_the_trainer_without_sp():
    work = Workload(global_batch=16, seq_len=512)
    result = search(MOE, H100, work, world_size=8, fixed={"tp": 2, "ep": 2}, options=trainer_options("bf16", H100),
                    keep=100)
    assert result.ranked
    assert all(e.layout.tp == 2 and e.layout.ep == 2 and not e.layout.sp for e in result.ranked)
    plan = auto_plan(MOE, world_size=8, global_batch=16, seq_len=512, cluster=H100, dtype="bf16")
    assert not (plan.tp > 1 and plan.sp)


def test_trainer_options_keep_16_bytes_per_parameter():
    # 3 layers (attention 4 h^2, GeLU MLP 2 h f, two norms), embedding and untied head; the
    # planner leaves out the final norm's h weights (negligible)
    params = 3 * (4 * 128 * 128 + 2 * 128 * 512 + 2 * 128) + 2 * 1000 * 128
    work = Workload(global_batch=4, seq_len=256)
    lay = Layout(dp=1, mbs=4, microbatches=1)
    for dtype in ("fp32", "bf16"):
        mem = evaluate(DENSE, H100, work, lay, trainer_options(dtype, H100)).memory_breakdown
        # fp32 weights and gradient, AdamW's two fp32 moments: 4 + 4 + 8
        assert (mem["parameters"], mem["gradients"], mem["optimizer_state"]) == (4 * params, 4 * params, 8 * params)
    published = evaluate(DENSE, H100, work, lay, Options()).memory_breakdown  # bf16 + fp32 grad + 12
    assert (published["parameters"], published["optimizer_state"]) == (2 * params, 12 * params)
    # The trainer's own RMSNorm (model/rms_norm.py) saves input and rstd on every device, and its
    # sequence parallelism keeps shards (parallel/sequence_parallel.py).
    for cluster in (H100, PRESETS["local"]):
        assert trainer_options("bf16", cluster).fused_norm and trainer_options("bf16", cluster).sp_regather


def test_fp32_runs_gather_four_bytes_per_parameter():
    work = Workload(global_batch=8, seq_len=256)
    lay = Layout(dp=8, mbs=1, microbatches=1, zero=3)
    no_overlap = dict(dp_overlap=False)
    t = {d: evaluate(DENSE, H100, work, lay, trainer_options(d, H100, **no_overlap)).breakdown["dp_comm"]
         for d in ("fp32", "bf16")}
    # Without overlap: the forward and the backward all-gather of every layer's parameters and
    # of the root's, 4 against 2 bytes each; the fp32 gradient reduce-scatter is the same in both.
    _, shared, _ = stage_params(DENSE, lay, 3, 0)
    per = shared / 4  # one collective per FSDP unit: 3 layers and the root

    def gathers(nbytes):
        return 2 * 4 * comm.all_gather(H100, per * nbytes, size=8, stride=1)

    assert t["fp32"] - t["bf16"] == pytest.approx(gathers(4) - gathers(2), rel=1e-9)


def test_plan_cli_plans_the_trainer_unless_any_runtime(capsys):
    argv = ["plan", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "1", "--global-batch", "4",
            "--seq-len", "128", "--fix", "mbs=4", "--json"]
    records = {}
    for extra in ([], ["--dtype", "bf16"], ["--dtype", "fp32"], ["--any-runtime"]):
        assert cli.run(argv + extra) == 0
        records[tuple(extra)] = json.loads(capsys.readouterr().out)["plans"][0]["memory_breakdown_gib"]
    assert records[()] == records[("--dtype", "bf16")]  # bf16 on a GPU preset by default
    assert records[("--dtype", "fp32")]["optimizer_state"] == records[()]["optimizer_state"]
    assert records[("--dtype", "fp32")]["activations"] > records[()]["activations"]
    other = records[("--any-runtime",)]
    assert other["optimizer_state"] == pytest.approx(records[()]["optimizer_state"] * 12 / 8)
    assert cli.run(argv + ["--any-runtime", "--dtype", "bf16"]) == 2
    assert "--dtype sets the phalanx trainer's precision" in capsys.readouterr().err


def test_train_plan_auto_plans_for_the_runs_dtype():
    from phalanx.model.by_name import model_config
    from phalanx.train.config import TrainConfig
    from phalanx.train.world_change import auto_plan_for

    plans = {}
    for dtype in ("fp32", "bf16"):
        cfg = TrainConfig(model="llama3-8b", plan="auto", cluster="dgx-h100", device="cpu", global_batch=64,
                          seq_len=2048, dtype=dtype)
        plans[dtype] = auto_plan_for(cfg, 8, model_config(cfg.model)).to_string()
        assert plans[dtype] == auto_plan(model_config("llama3-8b"), world_size=8, global_batch=64, seq_len=2048,
                                         cluster="dgx-h100", dtype=dtype).to_string()
    # fp32 activations (twice the bytes) do not fit the bf16 run's layout on 76 GiB
    assert plans["fp32"] != plans["bf16"]


def test_fsdp_without_no_sync_reduces_every_microbatch_into_the_shards():
    # Composer's FSDP (the published MPT runs): each micro-batch's backward reduce-scatters, so
    # the fp32 gradients accumulate sharded; the phalanx trainer accumulates them whole.
    from phalanx.planner.memory import state_bytes

    p, layer = 1e9, 1e8
    kw = dict(zero=3, shards=4, params=p, layer_params=layer, microbatches=4, pp=1)
    assert state_bytes(**kw)["gradients"] == 4 * p
    # the shards of the other layers, and the layer in backward whole in bf16 (its autograd grad)
    assert state_bytes(**kw, reduce_each_microbatch=True)["gradients"] == 4 * (p - layer) / 4 + 2 * layer
    work = Workload(global_batch=32, seq_len=256)
    lay = Layout(dp=8, mbs=1, microbatches=4, zero=3)
    t = {flag: evaluate(DENSE, H100, work, lay, Options(dp_overlap=False, reduce_each_microbatch=flag))
         .breakdown["dp_comm"] for flag in (False, True)}
    _, shared, _ = stage_params(DENSE, lay, 3, 0)
    one_step = 4 * comm.reduce_scatter(H100, shared / 4 * 4, size=8, stride=1)  # 4 units, fp32
    assert t[True] - t[False] == pytest.approx(3 * one_step, rel=1e-9)  # 3 more micro-batches reduce


def test_folded_experts_follow_ep_over_tp():
    """ep_over_tp=true (the trainer's MoE parallel folding): ep counts ranks of dp x tp, so each
    device holds n_experts / ep whole experts; the router stays whole on every tp rank."""
    n_moe = 2
    experts_per_layer = 8 * 3 * 256 * 128
    router = 256 * 8
    attention_and_heads = 2 * (4 * 256 * 256 + 2 * 256) / 2 + 2 * 1024 * 256 / 2
    folded = Layout(dp=2, tp=2, ep=4, ep_over_tp=True, mbs=1, microbatches=1)
    _, shared, experts = stage_params(MOE, folded, 2, n_moe, trainer_options("bf16", H100))
    assert experts == 2 * experts_per_layer / 4  # 2 experts of 8 per device
    assert shared == attention_and_heads + 2 * router


def test_folded_moe_block_activations_split_the_routed_rows_over_tp():
    s, b, h, k, f = 512, 2, 256, 2, 128
    kw = dict(seq=s, mbs=b, sp=False, recompute="none", moe=True, phalanx_model=True, tp=2)
    routed = 2 * s * b * k * h + 8 * s * b * k * f + 2 * s * b * k * h  # dispatch in, experts, out
    gathered = 2 * s * b * k * h  # the rows gathered back over tp, whole on each tp rank
    whole = layer_activation_bytes(MOE, tp_splits_experts=False, **kw)
    folded = layer_activation_bytes(MOE, tp_splits_experts=False, fold_experts=True, **kw)
    assert whole - folded == pytest.approx(routed / 2 - gathered)


def test_folded_layout_prices_half_the_expert_work_and_the_gather():
    """Same weights per device (dp=2,tp=2,ep=2 either way): folded, the routed expert GEMMs and
    the all-to-all bytes per device halve; an all-gather over tp is charged beside them."""
    options, work = trainer_options("bf16", H100), Workload(global_batch=8, seq_len=512)
    duplicated = evaluate(MOE, H100, work, Layout(dp=2, tp=2, ep=2, mbs=4, microbatches=1), options)
    folded = evaluate(MOE, H100, work, Layout(dp=2, tp=2, ep=2, ep_over_tp=True, mbs=4, microbatches=1), options)
    assert folded.breakdown["compute"] < duplicated.breakdown["compute"]
    nbytes = 4 * 512 * 2 * 256 * 2  # the micro-batch's 4 x 512 tokens' k=2 rows of h=256 in bf16
    # Each direction: dispatch and combine of this rank's half of the rows, one all-gather of
    # all of them over tp (forward: the gather; backward: the slice's transpose); 2 MoE layers.
    to_all = comm.all_to_all(H100, nbytes / 2, size=2, stride=1)
    gather = comm.all_gather(H100, nbytes, size=2, stride=1)
    assert folded.breakdown["ep_comm"] == pytest.approx(2 * 2 * (2 * to_all + gather))
    assert folded.memory_bytes < duplicated.memory_bytes


def test_the_search_offers_folded_ep_for_the_trainer():
    """With tp=2 on 8 devices (dp=4) the trainer's search tries ep_over_tp layouts, whose ep
    divides dp x tp = 8 (ep=8 only folded), beside the duplicated ones (ep divides dp)."""
    work = Workload(global_batch=16, seq_len=512)
    result = search(MOE, H100, work, world_size=8, fixed={"tp": 2, "pp": 1, "mbs": 4, "zero": 0},
                    options=trainer_options("bf16", H100), keep=1000)
    eps = {(e.layout.ep, e.layout.ep_over_tp) for e in result.ranked}
    assert eps == {(1, False), (2, False), (4, False), (2, True), (4, True), (8, True)}
    plans = [e for e in result.ranked if e.layout.ep_over_tp]
    assert all("ep_over_tp=true" in e.layout.plan.to_string() for e in plans)
