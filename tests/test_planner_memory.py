"""Activation and state memory against published formulas, and pruning by memory."""

import pytest

from phalanx.errors import UserError
from phalanx.model.by_name import model_config
from phalanx.model.config import ModelConfig
from phalanx.planner.cost import Options, evaluate
from phalanx.planner.hardware import PRESETS, Cluster
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.memory import TRAINER_PRECISION, layer_activation_bytes, offloaded_bytes, state_bytes
from phalanx.planner.report import explain
from phalanx.planner.search import auto_plan, search

# MHA + 4h GeLU, the model of Korthikanti et al.: s=2048, b=2, h=4096, a=32.
GPT = ModelConfig(name="gpt", vocab_size=50000, dim=4096, n_layers=8, n_heads=32, n_kv_heads=32,
                  ffn_dim=16384, mlp="gelu")
S, B, H, A = 2048, 2, 4096, 32


def act(**kw):
    base = dict(seq=S, mbs=B, tp=1, sp=False, recompute="none", moe=False, flash=False)
    return layer_activation_bytes(GPT, **{**base, **kw})


def test_activation_formulas_of_the_reference():
    sbh = S * B * H
    assert act() == pytest.approx(sbh * (34 + 5 * A * S / H))
    t = 4
    assert act(tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * A * S / (H * t)))
    assert act(tp=t, sp=True) == pytest.approx(sbh * (34 / t + 5 * A * S / (H * t)))
    assert act(tp=t, sp=True, recompute="selective") == pytest.approx(34 * sbh / t)
    assert act(recompute="full") == pytest.approx(2 * sbh)
    # Flash attention stores no s x s matrix: the selective figure without recomputing.
    assert act(tp=t, sp=True, flash=True) == pytest.approx(34 * sbh / t)
    # SP that keeps the gathered attention and MLP inputs (2 sbh each) whole instead of
    # gathering them again in backward: 30 sbh / t + 4 sbh.
    assert act(tp=t, sp=True, flash=True, sp_regather=False) == pytest.approx(30 * sbh / t + 4 * sbh)


def test_memory_of_a_hand_computed_layout():
    # pp=1, tp=1, dp=2, zero=0: every parameter at 18 bytes; activations of 8 layers of one
    # micro-batch (flash: 34 sbh each) plus one micro-batch of logits at 6 bytes.
    work = Workload(global_batch=4, seq_len=S)
    est = evaluate(GPT, PRESETS["dgx-h100"], work, Layout(dp=2, mbs=2, microbatches=1))
    params = 8 * (4 * H * H + 2 * H * 16384 + 2 * H) + 2 * 50000 * H
    state = sum(est.memory_breakdown[k] for k in ("parameters", "gradients", "optimizer_state"))
    assert state == pytest.approx(18 * params)
    assert est.memory_breakdown["comm_buffers"] == 2 * 25 * 2**20  # two 25 MiB gradient buckets
    assert est.memory_breakdown["activations"] == pytest.approx(8 * 34 * S * B * H)
    # The last stage's head: bf16 logits and their fp32 copy, the final norm's input and the output
    # projection's input (2 bytes each).
    assert est.memory_breakdown["logits"] == pytest.approx(S * B * 50000 * 6 + 2 * 2 * S * B * H)


def test_what_the_phalanx_trainer_stores_beyond_the_reference():
    # Grouped-query attention, SwiGLU: s=128, b=8, h=192, 6 heads of 32, 2 kv heads, f=512 (`small`).
    small = model_config("small")
    s, b, h, f = 128, 8, 192, 512
    sbh = s * b * h
    base = dict(seq=s, mbs=b, tp=1, sp=False, recompute="none", moe=False)
    reference = layer_activation_bytes(small, **base)
    # norm inputs 4, attention and MLP inputs 4, q 2, k and v 4 s b h_kv, output projection input 2, SwiGLU 8 s b f
    assert reference == pytest.approx(12 * sbh + 4 * s * b * 64 + 8 * s * b * f)
    # The same tensors (k and v at 2 heads, no weighted rows kept by the MoE combine), plus the two
    # norms' fp32 rstd and flash attention's fp32 log-sum-exp of each of the 6 heads, 4 bytes per row
    stats = 2 * 4 * s * b + 4 * s * b * 6
    assert layer_activation_bytes(small, **base, phalanx_model=True) == pytest.approx(reference + stats)
    # recompute=selective recomputes the attention core, whose log-sum-exp is then not kept
    selective = {**base, "recompute": "selective"}
    assert layer_activation_bytes(small, **selective, phalanx_model=True) == pytest.approx(reference + 2 * 4 * s * b)
    # torch's CPU composite norm (not the trainer's) also keeps each norm's x / rms
    assert layer_activation_bytes(small, **base, fused_norm=False) == pytest.approx(reference + 4 * sbh)
    moe = model_config("tiny-moe")
    kw = dict(seq=s, mbs=b, tp=1, sp=False, recompute="none", moe=True)
    extra = layer_activation_bytes(moe, **kw, phalanx_model=True) - layer_activation_bytes(moe, **kw)
    assert extra == pytest.approx(2 * 4 * s * b + 4 * s * b * moe.n_heads)
    # torch DDP's reducer keeps a second copy of the gradients (fp32 here) instead of two 25 MiB buckets
    work, lay = Workload(global_batch=16, seq_len=s), Layout(dp=2, mbs=8, microbatches=1)
    trainer = Options(precision=TRAINER_PRECISION["fp32"], phalanx_trainer=True)
    est = evaluate(small, PRESETS["dgx-h100"], work, lay, trainer)
    assert est.memory_breakdown["comm_buffers"] == pytest.approx(est.memory_breakdown["gradients"])
    assert evaluate(small, PRESETS["dgx-h100"], work, lay).memory_breakdown["comm_buffers"] == 2 * 25 * 2**20


def test_search_prunes_what_does_not_fit():
    small = Cluster(name="small", memory_gib=24.0, memory_reserved_gib=2.0)
    work = Workload(global_batch=64, seq_len=4096)
    model = model_config("llama3-8b")
    result = search(model, small, work, world_size=8)
    assert result.pruned_memory > 0 and result.ranked
    assert all(e.memory_bytes <= small.usable_bytes for e in result.ranked)
    # 8B with replicated Adam state (18 B/param = 135 GiB) cannot fit unsharded on one 24 GiB GPU.
    assert all(e.layout.zero == 3 or e.layout.tp * e.layout.pp > 1 for e in result.ranked)


def test_auto_plan_says_when_nothing_fits():
    tiny_gpu = Cluster(name="tiny", memory_gib=2.0, memory_reserved_gib=1.0)
    with pytest.raises(UserError, match="fits in 1.0 GiB"):
        auto_plan(model_config("llama3-70b"), world_size=2, global_batch=8, seq_len=4096, cluster=tiny_gpu)


@pytest.mark.parametrize("zero, microbatches, pp, expected", [
    # 1000 parameters on the rank, 100 per layer, 50 in the root unit (embedding, output), sharded 4
    # ways; (parameters, gradients, optimizer).
    (0, 4, 1, (2000, 4000, 12000)),      # replicated: 2 + 4 + 12 bytes each
    (1, 4, 1, (2000, 4000, 3000)),       # optimizer state sharded
    (2, 1, 1, (2500, 1100, 3000)),       # shard + the stage gathered; one micro-batch: gradients
                                         # reduce-scattered in backward: the other layers' fp32
                                         # shards and the layer in flight whole, in its weights'
                                         # bf16: 900 / 4 x 4 + 100 x 2
    (2, 4, 1, (2500, 4000, 3000)),       # several: fp32 gradients accumulate whole, reduced once
    (3, 1, 1, (800, 1100, 3000)),        # shard + the running layer and the root unit gathered (the
                                         # prefetched layer is an all-gather buffer until its turn)
    (3, 4, 1, (800, 4000, 3000)),
    (3, 4, 2, (2500, 4000, 3000)),       # under pp: gathered once, kept for the whole step
])
def test_state_bytes_per_zero_level(zero, microbatches, pp, expected):
    got = state_bytes(zero=zero, shards=4, params=1000, layer_params=100, microbatches=microbatches, pp=pp,
                      root_params=50)
    assert (got["parameters"], got["gradients"], got["optimizer_state"]) == pytest.approx(expected)


def test_fsdp_under_pp_counts_the_gathered_weights_and_accumulated_gradients():
    # The old model charged zero 3 under pp 18/dp bytes per parameter plus two layers; the
    # time model gathers once per step there, so the stage is resident whole (2 bytes) with its
    # fp32 gradients accumulating over the micro-batches (4 bytes).
    work = Workload(global_batch=16, seq_len=S)
    lay = Layout(dp=4, pp=2, mbs=1, microbatches=4, zero=3)
    est = evaluate(GPT, PRESETS["dgx-h100"], work, lay)
    stage = 4 * (4 * H * H + 2 * H * 16384 + 2 * H) + 50000 * H  # 4 layers + one embedding
    assert est.memory_breakdown["parameters"] == pytest.approx(2 * stage / 4 + 2 * stage)
    assert est.memory_breakdown["gradients"] == pytest.approx(4 * stage)
    assert est.memory_breakdown["optimizer_state"] == pytest.approx(12 * stage / 4)


def test_v_schedules_hold_what_their_orders_hold():
    # Walk each rank's order: a forward adds a half-stage chunk of activations, an input
    # gradient turns it into deferred weight-gradient inputs (at most the whole chunk), the
    # weight gradient (or a whole backward) frees it. The peak over every rank, in stages, is
    # the memory model's in-flight count, and counting the deferred inputs at full size does
    # not raise it: they never wait at the activation peak.
    from phalanx import layout_rules as rules
    from phalanx.planner.memory import in_flight_microbatches
    from phalanx.planner.pipeline_orders import dualpipev_order, zbv_order

    for schedule, order in (("zbv", zbv_order), ("dualpipev", dualpipev_order)):
        for p, m in ((2, 4), (4, 5), (4, 8), (4, 13), (8, 9), (8, 16), (8, 40)):
            if m < rules.min_microbatches(schedule, p):
                continue
            peaks = []
            for rank in range(p):
                act = w = peak_act = peak_both = 0
                for kind, _, _ in order(rank, p, m):
                    act += {"F": 1, "B": -1, "I": -1}.get(kind, 0)
                    w += {"I": 1, "W": -1}.get(kind, 0)
                    peak_act, peak_both = max(peak_act, act), max(peak_both, act + w)
                assert peak_both == peak_act
                peaks.append(peak_act)
            assert max(peaks) / 2 == in_flight_microbatches(schedule=schedule, pp=p, virtual=2, microbatches=m)
    # So zbv keeps what 1F1B keeps, pp = 2 micro-batches of its stage (2 chunks of 2 layers).
    work = Workload(global_batch=4, seq_len=S)
    zbv = evaluate(GPT, PRESETS["dgx-h100"], work, Layout(pp=2, mbs=1, microbatches=4, schedule="zbv", virtual=2))
    per_layer = layer_activation_bytes(GPT, seq=S, mbs=1, tp=1, sp=False, recompute="none", moe=False)
    assert zbv.memory_breakdown["activations"] == pytest.approx(2 * 4 * per_layer)


def test_state_bytes_with_offload_and_the_trainers_precision():
    # zero 3 over 4 shards, one micro-batch, offload: the device keeps the running layer's gathered
    # weights (2 bytes, bf16 param_dtype) and one layer's unsharded gradients (bf16 too); the shards of
    # weights (4 bytes, the trainer's fp32), gradients (4) and AdamW's two moments (8) are on the host.
    bf16 = TRAINER_PRECISION["bf16"]
    got = state_bytes(zero=3, shards=4, params=1000, layer_params=100, microbatches=1, pp=1, precision=bf16,
                      offload=True)
    assert got == pytest.approx({"parameters": 2 * 100, "gradients": 2 * 100, "optimizer_state": 0})
    assert offloaded_bytes(shards=4, params=1000, precision=bf16) == pytest.approx(
        {"parameters": 4 * 250, "gradients": 4 * 250, "optimizer_state": 8 * 250})
    # The trainer without offload: fp32 weights and moments, no master copy (16 bytes, not 18).
    fp32 = TRAINER_PRECISION["fp32"]
    got = state_bytes(zero=0, shards=4, params=1000, layer_params=100, microbatches=1, pp=1, precision=fp32)
    assert got == pytest.approx({"parameters": 4000, "gradients": 4000, "optimizer_state": 8000})
    # zero 2 in bf16: the fp32 shard beside the whole bf16 gathered copy.
    got = state_bytes(zero=2, shards=4, params=1000, layer_params=100, microbatches=4, pp=1, precision=bf16)
    assert got == pytest.approx({"parameters": 4 * 250 + 2 * 1000, "gradients": 4000, "optimizer_state": 8 * 250})


def test_offload_layout_keeps_its_shards_off_the_device():
    work = Workload(global_batch=8, seq_len=S)
    lay = Layout(dp=8, mbs=1, microbatches=1, zero=3, recompute="full")
    plain = evaluate(GPT, PRESETS["dgx-h100"], work, lay)
    off = evaluate(GPT, PRESETS["dgx-h100"], work, lay.replace(offload=True))
    params = 8 * (4 * H * H + 2 * H * 16384 + 2 * H) + 2 * 50000 * H
    assert off.host_breakdown["optimizer_state"] == pytest.approx(12 * params / 8)
    assert off.memory_breakdown["optimizer_state"] == 0
    moved = sum(off.host_breakdown.values())
    # All that moves leaves the device, except the shard of the layer in backward, which is not
    # there at the peak anyway (that layer's gradients are whole until its reduce-scatter).
    layer = 4 * H * H + 2 * H * 16384 + 2 * H
    assert plain.memory_bytes - off.memory_bytes == pytest.approx(moved - 4 * layer / 8)
    assert lay.replace(offload=True).plan.offload


def _offload_search(memory_gib: float):
    cluster = Cluster(name="c", memory_gib=memory_gib, memory_reserved_gib=2.0)
    # llama3-8b's 18 bytes per parameter over 8 GPUs is 16.8 GiB on each however it is split.
    return search(model_config("llama3-8b"), cluster, Workload(global_batch=8, seq_len=4096), world_size=8), cluster


def test_search_picks_offload_only_when_nothing_else_fits():
    result, cluster = _offload_search(14.0)
    assert result.offload_only and result.ranked
    assert all(e.layout.offload and e.layout.zero == 3 for e in result.ranked)
    assert any("offload=true" in line for line in explain(result, cluster.usable_bytes / 2**30))
    assert "offload=true" in result.ranked[0].layout.plan.to_string()


def test_search_does_not_offload_when_something_fits():
    result, cluster = _offload_search(80.0)
    assert result.ranked and not result.offload_only
    assert not any(e.layout.offload for e in result.ranked)
    assert not any("offload" in line for line in explain(result, cluster.usable_bytes / 2**30))


def test_autocast_over_fp32_weights_in_the_formula():
    # Autocast over fp32 weights (the trainer's param_dtype=fp32 under --dtype bf16): the residual
    # stream stays fp32 (norm tensors twice as wide), q, k, v and w1, w3 cast their input anew
    # (2 x (3 + 2) bytes per s b h, one copy each counted already).
    small = model_config("small")
    sbh = 128 * 8 * small.dim
    base = dict(seq=128, mbs=8, tp=1, sp=False, recompute="none", moe=False, phalanx_model=True)
    widened = layer_activation_bytes(small, **base, autocast_fp32=True, wide_norms=True)
    assert widened - layer_activation_bytes(small, **base) == pytest.approx(4 * sbh + 2 * (2 + 1) * sbh)


def test_bf16_compute_copies_in_the_trainer():
    # --dtype bf16 without FSDP: the trainer keeps a bf16 copy of every weight, the embedding's
    # and the output's too, for the step (parallel/mixed_precision.py), and its activations are a
    # 16-bit model's, with no autocast terms.
    small = model_config("small")
    s, b = 128, 8

    def per_layer(**kw) -> float:
        return layer_activation_bytes(small, **{**dict(seq=s, mbs=b, tp=1, sp=False, recompute="none", moe=False), **kw})

    work, one = Workload(global_batch=8, seq_len=s), Layout(mbs=8, microbatches=1)
    bf16 = Options(precision=TRAINER_PRECISION["bf16"], phalanx_trainer=True)
    trainer = evaluate(small, PRESETS["dgx-h100"], work, one, bf16).memory_breakdown
    plain = evaluate(small, PRESETS["dgx-h100"], work, one, Options(precision=TRAINER_PRECISION["bf16"]))
    params = 6 * (2 * 192 * 192 + 2 * 192 * 64 + 3 * 192 * 512 + 2 * 192) + 2 * 256 * 192  # embedding and output
    model_terms = 6 * (per_layer(phalanx_model=True) - per_layer())  # the trainer's own model code
    assert trainer["activations"] - plain.memory_breakdown["activations"] == pytest.approx(2 * params + model_terms)
    # FSDP (zero 3) gathers the bf16 weights itself: no copies of the trainer's own.
    sharded = Layout(dp=2, mbs=4, microbatches=1, zero=3)
    assert evaluate(small, PRESETS["dgx-h100"], work, sharded, bf16).memory_breakdown["activations"] == pytest.approx(
        6 * per_layer(mbs=4, phalanx_model=True))
