"""`Options.fp32_compute`: a run without --fp16/--bf16 computes at the device's fp32 peak
(`Cluster.fp32_tflops`) and moves 4-byte activations: on zero-latency links its tensor-parallel
all-reduces and pipeline sends take exactly twice the 16-bit run's time, its GEMMs the bf16
peak over the fp32 peak times longer; unfused attention's softmax runs as torch's three passes
(Megatron's fused kernel needs 16-bit input)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from phalanx.errors import UserError
from phalanx.model.config import ModelConfig
from phalanx.plan import Plan
from phalanx.planner.cost import evaluate
from phalanx.planner.hardware import PRESETS, Cluster
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.options import Options
from phalanx.planner.stage_time import layer_cost

MODEL = ModelConfig(name="m", vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=16, ffn_dim=4096,
                    mlp="gelu", max_seq_len=2048)


def _cluster(**kw) -> Cluster:
    return dataclasses.replace(PRESETS["dgx-a100"], fast_domain=4, devices_per_node=4, intra_latency_us=0.0,
                               inter_latency_us=0.0, **kw)


def test_fp32_doubles_tp_and_pipeline_bytes():
    cluster = _cluster(fp32_tflops=19.5)
    layout = Layout(Plan(tp=4, pp=2, microbatches=8), mbs=2)
    work = Workload(global_batch=16, seq_len=2048)
    half = evaluate(MODEL, cluster, work, layout, Options(flash_attention=False))
    full = evaluate(MODEL, cluster, work, layout, Options(flash_attention=False, fp32_compute=True))
    assert math.isclose(full.breakdown["pp_comm"], 2 * half.breakdown["pp_comm"], rel_tol=1e-9)
    assert math.isclose(full.breakdown["tp_comm"], 2 * half.breakdown["tp_comm"], rel_tol=1e-9)
    assert full.breakdown["compute"] > 10 * half.breakdown["compute"]  # 312 bf16 against 19.5 fp32 TFLOP/s


def test_fp32_gemms_at_the_fp32_peak():
    cluster = _cluster(fp32_tflops=19.5)
    kw = dict(seq=2048, mbs=2, tp=1, ep=1, sp=False, moe=False, flash=True, memory_bw=1e30, overhead=0.0)
    bf16 = layer_cost(MODEL, cluster, peak=312e12, **kw)
    fp32 = layer_cost(MODEL, cluster, peak=19.5e12, act_bytes=4, **kw)
    assert fp32.gemm_f == pytest.approx(bf16.gemm_f * 312 / 19.5, rel=1e-9)  # memory time zero: FLOPs alone
    # Without fp32_tflops a cluster's fp32 run is priced at its peak_tflops (not known otherwise).
    assert _cluster().compute_flops_per_rank(8, fp32=True) == _cluster().peak_tflops * 1e12


def test_fp32_softmax_is_three_passes():
    """Scores through HBM per element: 16-bit fused 4 forward and 6 backward (+5 dropout each);
    fp32 torch scale, mask fill and softmax 25 forward and 29 backward (+9 dropout each)."""
    cluster = _cluster()
    kw = dict(seq=2048, mbs=2, tp=1, ep=1, sp=False, moe=False, flash=False, peak=1e30, overhead=0.0)
    bw = 1e12
    scores = 2 * 2048 * MODEL.n_heads * 2048
    half = layer_cost(MODEL, cluster, memory_bw=bw, **kw)
    full = layer_cost(MODEL, cluster, memory_bw=bw, act_bytes=4, **kw)
    assert half.attention_f == pytest.approx(scores * (4 + 5) / bw, rel=1e-6)
    assert half.attention_b == pytest.approx(scores * (6 + 5) / bw, rel=1e-6)
    assert full.attention_f == pytest.approx(scores * (25 + 9) / bw, rel=1e-6)
    assert full.attention_b == pytest.approx(scores * (29 + 9) / bw, rel=1e-6)


def test_negative_fp32_peak_is_an_error():
    with pytest.raises(UserError, match="fp32_tflops=-1.0 must not be negative"):
        _cluster(fp32_tflops=-1.0)
