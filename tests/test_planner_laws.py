"""Laws the time model must obey whatever its constants: monotonic in the direction physics
says, over sweeps of layouts (each assertion compares two predictions of the same job)."""

import math

import pytest

from phalanx.model.config import ModelConfig
from phalanx.planner.cost import Options, evaluate
from phalanx.planner.hardware import PRESETS
from phalanx.planner.layout import Layout, Workload

A100, H100 = PRESETS["dgx-a100"], PRESETS["dgx-h100"]


def gpt(h, layers, heads, vocab=51200):
    return ModelConfig(name="gpt", vocab_size=vocab, dim=h, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                       ffn_dim=4 * h, mlp="gelu")


def per_gpu_tokens_per_s(est):
    return est.tokens_per_s / est.world_size


@pytest.mark.parametrize("cluster, recompute, regathers", [(H100, "none", False), (H100, "full", False),
                                                           (A100, "full", False), (A100, "full", True)])
def test_zero3_more_dp_at_fixed_batch_never_raises_per_gpu_throughput_once_comm_bound(cluster, recompute, regathers):
    # A 6.7B GPT at sequence 512 on one sequence per micro-batch: each micro-batch's compute is
    # small beside gathering 13 GB of bf16 weights twice (three times where recompute
    # regathers), so the step is bound by ZeRO-3's traffic from the first node on. Global
    # batch 1,024 sequences.
    model, work = gpt(4096, 32, 32), Workload(global_batch=1024, seq_len=512)
    rates, bound = [], []
    for dp in (16, 32, 64, 128, 256, 512, 1024):
        lay = Layout(dp=dp, mbs=1, microbatches=1024 // dp, zero=3, recompute=recompute)
        est = evaluate(model, cluster, work, lay, Options(recompute_regathers=regathers))
        bound.append(est.breakdown["dp_comm"] > 0.2 * est.step_time_s)  # communication-bound
        rates.append(per_gpu_tokens_per_s(est))
    first = bound.index(True)  # from here on the traffic no longer hides, and stays so
    assert first <= 3 and all(bound[first:]), bound  # at least four points (128 to 1,024 GPUs)
    rates = rates[first:]
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in zip(rates, rates[1:])), rates
    # Not a flat line either: each gather's ring latency grows with dp (1,023 hops at 1,024).
    assert rates[-1] < 0.8 * rates[0], rates


def test_zero3_recompute_gathers_again_only_where_the_runtime_does():
    # Without overlap the gathers show whole. FSDP2 around the checkpointed block (the
    # trainer; tests/test_planner_fsdp_gathers.py) gathers nothing more for recompute;
    # per-submodule hooks (Options.recompute_regathers, DeepSpeed ZeRO-3) gather once more per
    # micro-batch, only for the layers that recompute.
    model, work = gpt(4096, 32, 32), Workload(global_batch=256, seq_len=512)
    base = Layout(dp=64, mbs=1, microbatches=4, zero=3)

    def dp_comm(lay, regathers):
        return evaluate(model, H100, work, lay, Options(dp_overlap=False, recompute_regathers=regathers)).breakdown["dp_comm"]

    none = dp_comm(base, True)
    full = base.replace(recompute="full")
    assert dp_comm(full, False) == pytest.approx(dp_comm(base, False), rel=1e-12)
    # dp_comm = m (2 + share) AG + RS + fixed: full - none is m AG, and a quarter of the layers
    # recomputed (8 of 32) a quarter of it.
    assert dp_comm(full, True) > none
    quarter = dp_comm(full.replace(recompute_layers=8), True)
    assert quarter - none == pytest.approx((dp_comm(full, True) - none) / 4, rel=1e-9)


LAYOUTS = [
    # (model, cluster, workload, layout, options): tp with sp (regather on and off), pp
    # schedules, ZeRO levels; each is evaluated with every count of checkpointed layers.
    (gpt(4096, 32, 32), H100, Workload(global_batch=64, seq_len=2048),
     Layout(dp=4, tp=2, mbs=1, microbatches=16, sp=True), Options(sp_regather=True)),
    (gpt(4096, 32, 32), H100, Workload(global_batch=64, seq_len=2048),
     Layout(dp=4, tp=2, mbs=1, microbatches=16, sp=True, zero=3), Options()),
    (gpt(5120, 40, 40), A100, Workload(global_batch=64, seq_len=2048),
     Layout(dp=2, tp=4, pp=4, mbs=1, microbatches=32, sp=True, schedule="1f1b", zero=1), Options(sp_regather=True)),
    (gpt(5120, 40, 40), A100, Workload(global_batch=64, seq_len=2048),
     Layout(dp=2, tp=4, pp=4, mbs=1, microbatches=32, sp=True, schedule="zbv", virtual=2), Options()),
    (gpt(5120, 40, 40), A100, Workload(global_batch=64, seq_len=2048),
     Layout(dp=2, tp=4, pp=4, mbs=1, microbatches=32, sp=True, schedule="dualpipev", virtual=2),
     Options(sp_regather=True)),
    (gpt(5120, 40, 40), H100, Workload(global_batch=64, seq_len=2048),
     Layout(dp=4, tp=2, pp=4, mbs=1, microbatches=16, sp=True, schedule="interleaved", virtual=2, zero=3),
     Options(sp_regather=True)),
]


@pytest.mark.parametrize("model, cluster, work, lay, options", LAYOUTS)
def test_checkpointing_costs_time_and_more_layers_cost_more(model, cluster, work, lay, options):
    none = evaluate(model, cluster, work, lay, options).step_time_s
    chunk = math.ceil(model.n_layers / (lay.pp * (2 if lay.schedule in ("zbv", "dualpipev") else lay.virtual)))
    times = [evaluate(model, cluster, work, lay.replace(recompute="full", recompute_layers=k), options).step_time_s
             for k in range(1, chunk + 1)]
    every = evaluate(model, cluster, work, lay.replace(recompute="full"), options).step_time_s
    assert times[-1] == pytest.approx(every, rel=1e-12)  # recompute_layers=chunk is all of them
    # Any recompute never costs less than none; fewer layers never cost more than all.
    assert none <= times[0] * (1 + 1e-12), (none, times[0])
    assert all(a <= b * (1 + 1e-12) for a, b in zip(times, times[1:])), times


def test_tensor_parallelism_across_nodes_is_much_slower_than_inside_one():
    # A 175B GPT on 512 A100s: tp=16 spans two 8-GPU nodes, so its all-reduces run at the
    # nodes' NICs (8 x 24 GB/s per node pair at best, against NVLink's 229), and each GPU
    # moves twice the activation bytes per token of tp=8. Same job, same everything else.
    model, work = gpt(12288, 96, 96), Workload(global_batch=1536, seq_len=2048)
    steps = {}
    for tp in (8, 16):
        dp = 512 // tp
        lay = Layout(dp=dp, tp=tp, mbs=1, microbatches=1536 // dp, sp=True, zero=1, recompute="full")
        steps[tp] = evaluate(model, A100, work, lay)
    t8, t16 = steps[8].breakdown["tp_comm"], steps[16].breakdown["tp_comm"]
    assert t16 > 2.4 * t8  # twice the bytes, each slower than on NVLink
    assert steps[16].step_time_s > 1.12 * steps[8].step_time_s
