"""The mixed-cluster planner's published validation (benchmarks/planner_published_mixed.py) and
the pipeline-send option it needed.

`pp_partitioned_sends` (DeepSpeed's pipe_partitioned, Megatron's scatter-gather): each tp rank
sends 1/tp of the boundary, so the pipeline sends' time, pure bandwidth on a zero-latency link,
falls by exactly tp; nothing else in the step moves."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from phalanx.plan import Plan
from phalanx.planner import comm
from phalanx.planner.cost import evaluate
from phalanx.planner.hardware import PRESETS
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.mixed_cluster import mixed_cluster_from_dict
from phalanx.planner.mixed_search import evaluate_mixed_plan
from phalanx.planner.options import Options

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("planner_published_mixed", ROOT / "benchmarks/planner_published_mixed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_partitioned_sends_divide_pipeline_traffic_by_tp():
    model = _bench().opt_350m()
    cluster = dataclasses.replace(PRESETS["dgx-a100"], fast_domain=4, devices_per_node=4, inter_latency_us=0.0,
                                  intra_latency_us=0.0)
    layout = Layout(Plan(tp=4, pp=2, microbatches=8), mbs=2)
    work = Workload(global_batch=16, seq_len=2048)
    whole = evaluate(model, cluster, work, layout, Options())
    split = evaluate(model, cluster, work, layout, Options(pp_partitioned_sends=True))
    assert math.isclose(split.breakdown["pp_comm"] * 4, whole.breakdown["pp_comm"], rel_tol=1e-9)
    assert whole.breakdown["pp_comm"] > 0
    assert split.breakdown["compute"] == whole.breakdown["compute"]


def test_split_rule_and_representable_rows():
    bench = _bench()
    halves = bench.split_halves(bench.ROWS)
    # Alternating down the order the rows became representable: no row changed half once seen.
    assert halves == {"N2_D1": "visible", "N3_D1": "hold-out", "N4_D1": "visible", "N2_D2": "hold-out",
                      "N4_D4": "visible", "N6_D6": "hold-out"}
    assert bench.transformer_split((5, 7, 7, 7)) == "4:7:7:6"  # embedding and head are Sailor's layers too
    for row in bench.ROWS:
        if not bench.representable(row):
            assert 0 < bench.evaluate(row) < 1e4


def test_dp_with_tp_over_two_equal_groups_prices_as_the_homogeneous_model():
    """`dp=8,tp=2` over two groups of one dgx-h100 node each, the link between them the nodes'
    own: the same cluster split in two, so the mixed pricing (each dp rank of 2 devices inside
    a group, the all-reduce at the slowest link) must give the homogeneous model's step."""
    model = _bench().opt_350m()
    h100 = PRESETS["dgx-h100"]
    mixed = mixed_cluster_from_dict({"groups": [{"preset": "dgx-h100", "nodes": 1}, {"preset": "dgx-h100", "nodes": 1}]},
                                    source="two.toml")
    plan = Plan(dp=8, tp=2, microbatches=2)
    priced = evaluate_mixed_plan(model, mixed, 2048, 64, plan, lambda c: Options())
    homogeneous = evaluate(model, h100, Workload(global_batch=64, seq_len=2048), Layout(plan, mbs=4), Options())
    assert priced.step_time_s == pytest.approx(homogeneous.step_time_s, rel=1e-9)
    assert priced.plan.shares == "8:8:8:8:8:8:8:8"


def test_pipeline_over_two_equal_groups_prices_as_the_homogeneous_model():
    """`pp=2,tp=8` over two groups of one dgx-h100 node each, the link between them the nodes'
    own, the homogeneous split given: the same cluster split in two, so the mixed pipeline must
    give the homogeneous model's step. The sends that cross groups are counted once (at the
    between-groups link), not again at the group's own links."""
    model = _bench().opt_350m()
    h100 = PRESETS["dgx-h100"]
    mixed = mixed_cluster_from_dict({"groups": [{"preset": "dgx-h100", "nodes": 1}, {"preset": "dgx-h100", "nodes": 1}],
                                     "between_bw_gbs": h100.inter_bw_gbs, "between_latency_us": h100.inter_latency_us},
                                    source="two.toml")
    plan = Plan(tp=8, pp=2, microbatches=16, schedule="1f1b", split="12:12")
    priced = evaluate_mixed_plan(model, mixed, 2048, 32, plan, lambda c: Options())
    homogeneous = evaluate(model, h100, Workload(global_batch=32, seq_len=2048), Layout(plan, mbs=2), Options())
    assert homogeneous.breakdown["pp_comm"] > 0.01 * homogeneous.step_time_s  # the sends matter here
    assert priced.step_time_s == pytest.approx(homogeneous.step_time_s, rel=1e-9)


def test_sailor_runs_priced_in_fp32():
    """The MIT rows were trained without --fp16/--bf16 (Megatron's fp32 default): the
    benchmark prices them with `fp32_compute` at each GPU's fp32 peak, and its tp all-reduces
    at the bus bandwidth that gives Aceso's measured 16 MiB time back."""
    bench = _bench()
    assert bench.OPTIONS.fp32_compute and not bench.OPTIONS.dp_overlap
    titan = bench.group_cluster("Titan-RTX", 8)
    assert titan.compute_flops_per_rank(8, fp32=True) == 16.3e12
    assert comm.all_reduce(titan, bench.MIB16, size=8, stride=1) == pytest.approx(5.584e-3, rel=1e-9)


def _amp():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    # Imported when run, not at the top: a benchmark module, found once benchmarks/ is on the path.
    import published_mixed_amp

    return published_mixed_amp


def test_amp_rows_split_and_units():
    """AMP's halves, fixed from the layouts alone before any row was evaluated: representable
    rows in the results file's order, alternating; AMP's 30 units map to 24 transformer layers."""
    amp = _amp()
    halves = amp.split_halves()
    assert len(halves) == 23 and list(halves)[:4] == ["amp00", "amp01", "amp02", "amp03"]
    assert [halves[k] for k in ("amp00", "amp01", "amp08", "amp43")] == ["visible", "hold-out", "visible", "visible"]
    row = amp.ROWS[0]
    assert amp.transformer_split(row) == [5, 7, 6, 6]  # [0, 7, 14, 20, 30]: embedding and a no-op first
    assert amp.representable(amp.ROWS[7]) == "a pipeline stage on both GPU types"  # pp=2: nodes 2 (V100) and 3 (T4)
    assert "did not run" in amp.representable(amp.ROWS[10])


def test_amp_framework_cost_gives_the_profiled_forward_back():
    """The framework time per layer pass taken from AMP's profiles: the cost model's layer
    forward plus it is the profiled forward (mp=1), and tp adds the mean extra of mp=2 and 4."""
    amp = _amp()
    for gpu in ("V100", "T4"):
        fw = amp.framework_costs(gpu)
        assert fw.layer_overhead_us > 0 and fw.tp_layer_overhead_us > 0  # the profiles sit above the FLOPs
        assert amp.modelled_forward_s(gpu, 1) + fw.layer_overhead_us * 1e-6 == pytest.approx(
            amp.PROFILED_FORWARD_MS[gpu][1] * 1e-3, rel=1e-9)
        extra = [amp.PROFILED_FORWARD_MS[gpu][tp] * 1e-3 - amp.modelled_forward_s(gpu, tp) for tp in (2, 4)]
        assert fw.layer_overhead_us + fw.tp_layer_overhead_us == pytest.approx(sum(extra) / 2 * 1e6, rel=1e-9)
