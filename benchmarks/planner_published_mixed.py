"""Predicted vs measured step time for published training runs on mixed GPU clusters.

The mixed-cluster planner (phalanx/planner/mixed_*.py, docs/planner.md "Mixed clusters") is
checked here as benchmarks/planner_published.py checks the homogeneous one: every row is a run
someone else measured, its layout evaluated as published (`evaluate_mixed_plan`, the plan's
own `split=`), one set of efficiency parameters (the Cluster defaults) for every GPU, nothing
fitted to a row.

Source: Sailor (Strati et al., SOSP'25), https://github.com/eth-easl/sailor, the simulator
validation runs on the MIT cluster of mixed consumer GPUs (README: "8-Titan-RTX, 8-RTX-2080, and
8-RTX-3090" nodes), files sailor/Planner/simulations/validation/mit/N*/plan_config_*.json:
OPT-350M (24 layers, hidden 1024, 16 heads, sequence 2,048, Aceso configs
aceso_validation_mit/configs/OPT-350_*.json), timed with Aceso's Megatron-LM runtime in fp32
(OPTIONS below says how that was read off the repository), no activation checkpointing,
micro-batch 2, the layout per stage (GPU type, tensor-parallel degree, dp replicas) and
`real`, the measured seconds per iteration. The cluster's links are measurements of it:
all-reduce inside a node from Aceso's profiler run on these nodes (ALL_REDUCE_16MIB_MS),
send/recv between two nodes from Sailor (multizone_bandwidths_het.json; inside a node,
intra_node_bandwidths.json, the largest send/recv bandwidth at the group's size); peaks and
memory from NVIDIA's datasheets (below).

Why the first version was about 2x optimistic (visible half only): it priced the runs as fp16
mixed precision (tensor-core peaks, 2-byte activations), but they ran in fp32 (CUDA-core peaks
4-8x lower, every activation, send and tp all-reduce twice the bytes, and unfused fp32
softmax's separate passes); and it took Sailor's send/recv bandwidths for the all-reduce bus
bandwidth, 2-18x what NCCL reaches over these PCIe nodes. One error went the other way: a
pipeline's sends between groups were counted twice (at the group's links and again at the
between-groups link), now once.

Which rows count: the mixed planner prices a pipeline whose every stage sits in one group
(one GPU type), and data parallelism over groups (`dp=N,tp=T`, each dp rank inside one group;
`phalanx simulate` prices tp > 1 so, the trainer's uneven shares being tp=1). Sailor's rows
whose pipeline stages mix GPU types across dp replicas are printed as "not representable" and
left out of both medians (what the mixed planner cannot express yet, not an error of its model).

The split, fixed before each row was first evaluated: rows in the order they became
representable, then of their file names, alternating visible (the only half a modelling
decision may look at) and hold-out (its median estimates the error on runs nobody looked at).
The three pipelines came first (N2_D1 visible, N3_D1 hold-out, N4_D1 visible); the three dp
rows when dp with tp > 1 was priced, after those three had been looked at (N2_D2 hold-out,
N4_D4 visible, N6_D6 hold-out), so no row changed half once its error was seen.

A second source, AMP's measured layouts on V100 + T4 nodes, is in published_mixed_amp.py (its
own docstring: source, cluster, split rule); the script prints both, each source's halves and
the two pooled.

    PYTHONPATH=. python benchmarks/planner_published_mixed.py [--visible-only] [--record]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from phalanx.model.config import ModelConfig
from phalanx.plan import Plan
from phalanx.planner.hardware import Cluster
from phalanx.planner.memory import TRAINER_PRECISION
from phalanx.planner.mixed_cluster import Group, MixedCluster
from phalanx.planner.mixed_search import evaluate_mixed_plan
from phalanx.planner.options import Options

sys.path.insert(0, str(Path(__file__).resolve().parent))
import published_mixed_amp as amp  # noqa: E402

GB = 1e9


def opt_350m() -> ModelConfig:
    """OPT-350M as Megatron-DeepSpeed builds it for Sailor: a GPT decoder, 4h GeLU-style MLP
    (OPT's ReLU costs the same FLOPs), learned positions, vocabulary 50,272."""
    return ModelConfig(name="opt-350m", vocab_size=50272, dim=1024, n_layers=24, n_heads=16, n_kv_heads=16,
                       ffn_dim=4096, mlp="gelu", max_seq_len=2048)


# Datasheet figures, dense: fp16 tensor-core peak with fp32 accumulation, and the fp32 peak
# (CUDA cores), which is what these fp32 runs compute at (OPTIONS below): NVIDIA Ampere GA102
# whitepaper (RTX 3090: 71 and 35.6 TFLOP/s, 82 SMs, 24 GB, 936 GB/s, 350 W); NVIDIA Turing
# TU102 whitepaper (Titan RTX: 130 and 16.3 TFLOP/s, 72 SMs, 24 GB, 672 GB/s, 280 W; RTX
# 2080 Ti at reference clocks: 53.8 and 13.4 TFLOP/s, 68 SMs, 11 GB, 616 GB/s, 250 W).
# Sailor's "RTX-2080" has 11 GiB (basic_cluster_config.json, constants.py): the 2080 Ti's memory.
GPUS = {
    "RTX-3090": dict(peak_tflops=71.0, fp32_tflops=35.6, sm_count=82, memory_gib=24.0, hbm_tbs=0.936, busy_w=350.0),
    "Titan-RTX": dict(peak_tflops=130.0, fp32_tflops=16.3, sm_count=72, memory_gib=24.0, hbm_tbs=0.672, busy_w=280.0),
    "RTX-2080": dict(peak_tflops=53.8, fp32_tflops=13.4, sm_count=68, memory_gib=11.0, hbm_tbs=0.616, busy_w=250.0),
}
# All-reduce inside one node, measured on these nodes by Aceso's profiler for Sailor
# (sailor/Planner/baselines/Aceso/profiler/<GPU>/profiled-data-fp16/prim_OPT-350_all_reduce_<n>gpus.csv,
# NCCL over PCIe, no NVLink but the RTX-3090 pairs' bridge): milliseconds for a 16 MiB
# buffer, the size these runs all-reduce in every tensor-parallel layer (2 sequences x 2,048
# tokens x 1,024 fp32 values). Sailor's send/recv bandwidths (INTRA_BPS) are 2-18x higher
# than what these all-reduces reach: NCCL's ring over PCIe without peer-to-peer goes through
# host memory.
ALL_REDUCE_16MIB_MS = {
    "RTX-3090": {2: 0.456, 4: 5.218, 8: 22.028},
    "Titan-RTX": {2: 4.186, 4: 5.146, 8: 5.584},
    "RTX-2080": {2: 4.223, 4: 5.146, 8: 6.807},
}
MIB16 = 16 * 2**20


def measured_all_reduce(gpu: str) -> tuple[tuple[int, float, float], ...]:
    """`Cluster.measured_groups` rows (size, latency us, bus GB/s): the bus bandwidth at which
    the ring formula 2(n-1)/n S / busbw gives the measured time at 16 MiB (latency inside it)."""
    return tuple((n, 0.0, 2 * (n - 1) / n * MIB16 / (ms * 1e-3) / GB) for n, ms in ALL_REDUCE_16MIB_MS[gpu].items())
# Sailor's measured send/recv bandwidth inside one node, bytes/s, by GPUs used in the node
# (intra_node_bandwidths.json, the fit's "max network bandwidth").
INTRA_BPS = {
    "RTX-3090": {2: 49769218367.6, 4: 7861831446.0, 8: 5326931791.9},
    "Titan-RTX": {2: 10824370647.2, 4: 12334115354.7, 8: 24304314860.6},
    "RTX-2080": {2: 10755624404.2, 4: 22666820280.2, 8: 24551701788.1},
}
# Between two nodes, bytes/s of the node's link (multizone_bandwidths_het.json): the RTX-3090
# node meets every node at about 0.116 GB/s (a 1 Gb/s link); Titan-RTX and RTX-2080 nodes
# meet each other at 2.86 GB/s.
BETWEEN_BPS = {frozenset({"Titan-RTX"}): 2856544700.7, frozenset({"RTX-2080"}): 2855813401.7,
               frozenset({"Titan-RTX", "RTX-2080"}): 2857696615.1}
SLOW_NODE_BPS = 115701787.8
"""Any pair with the RTX-3090 node."""


def node_link_bps(a: str, b: str) -> float:
    return SLOW_NODE_BPS if "RTX-3090" in (a, b) else BETWEEN_BPS[frozenset({a, b})]


def group_cluster(gpu: str, used: int) -> Cluster:
    """One node of `gpu`, `used` of its GPUs in the run: the fast domain is the node's PCIe
    (Sailor's measured bandwidth at that count), each device's share of the node's network
    link is the link over the devices using it."""
    slowest_peer = min(node_link_bps(gpu, other) for other in GPUS)
    return Cluster(name=gpu.lower(), devices_per_node=used, fast_domain=used, **GPUS[gpu],
                   intra_bw_gbs=INTRA_BPS[gpu][used] / GB, inter_bw_gbs=slowest_peer / used / GB,
                   measured_groups=measured_all_reduce(gpu),
                   intra_latency_us=10.0, inter_latency_us=50.0)


@dataclass(frozen=True)
class Row:
    label: str
    stages: tuple[tuple[tuple[str, ...], int], ...]
    """Per stage: (the GPU type of each dp replica, the tp degree)."""
    layers: tuple[int, ...]
    """Sailor's layers per stage, embedding and output head counted as layers (26 in all)."""
    global_batch: int
    measured_s: float
    mbs: int = 2


def _row(label, stages, layers, gbs, real) -> Row:
    return Row(label=label, stages=tuple((tuple(g), tp) for g, tp in stages), layers=tuple(layers),
               global_batch=gbs, measured_s=real)


# Every MIT row of Sailor's validation, in the order of their file names.
ROWS = [
    _row("N2_D1", [(["RTX-3090"], 2), (["Titan-RTX"], 2)], [12, 14], 256, 119.83914),
    _row("N2_D2", [(["Titan-RTX", "RTX-3090"], 2)], [26], 256, 91.78),
    _row("N3_D1", [(["RTX-3090"], 8), (["RTX-2080"], 8), (["Titan-RTX"], 8)], [8, 9, 9], 144, 59.45533),
    _row("N4_D1", [(["RTX-3090"], 8), (["RTX-2080"], 8), (["Titan-RTX"], 8), (["RTX-2080"], 8)], [5, 7, 7, 7], 256,
         83.76622),
    _row("N4_D2", [(["RTX-3090", "RTX-2080"], 8), (["Titan-RTX", "RTX-2080"], 8)], [12, 14], 256, 66.06712),
    _row("N4_D4", [(["RTX-3090", "RTX-2080", "Titan-RTX", "RTX-2080"], 8)], [26], 256, 83.45238),
    _row("N6_D2", [(["RTX-3090", "RTX-2080"], 8), (["RTX-2080", "Titan-RTX"], 8), (["RTX-2080", "Titan-RTX"], 8)],
         [8, 9, 9], 288, 59.45533),
    _row("N6_D3", [(["RTX-3090", "RTX-2080", "RTX-2080"], 8), (["Titan-RTX", "RTX-2080", "Titan-RTX"], 8)], [12, 14],
         288, 54.2392),
    _row("N6_D6", [(["RTX-3090", "RTX-2080", "RTX-2080", "Titan-RTX", "RTX-2080", "Titan-RTX"], 8)], [26], 288, 70.78508),
]

# How the runs were made, read off Sailor's repository: the MIT rows were timed with Aceso's
# runtime, a Megatron-LM fork (Aceso/scripts_mit/run_mit.sh runs scripts/aceso_opt_execute.sh
# on each node), whose command line gives neither --fp16 nor --bf16, so Megatron's
# params_dtype stays torch.float (Aceso/runtime/megatron/arguments.py): the runs train in fp32
# (`fp32_compute`: the fp32 peak, 4-byte activations, sends and tp all-reduces; fp32 weights,
# gradients and Adam moments). Sailor's own Megatron-DeepSpeed launchers pass no precision flag
# either, and Sailor's per-layer profiles of these GPUs (Planner/simulations/profiles_tmp.json)
# match Aceso's fp32 operator profiles of them, not its fp16 ones (2-5x faster). The rest:
# unfused attention (fp32; Turing has no flash-attention 2 kernels), no sequence parallelism;
# `--DDP-impl local` (the script's), whose gradient all-reduce runs after the last backward,
# not overlapped (`dp_overlap=False`); Megatron's scatter_gather_tensors_in_pipeline (on by
# default) sends each tp rank's 1/tp of a boundary (`pp_partitioned_sends`).
OPTIONS = Options(flash_attention=False, pp_partitioned_sends=True, fp32_compute=True, dp_overlap=False,
                  precision=TRAINER_PRECISION["fp32"])


def representable(row: Row) -> str:
    """Why the mixed planner cannot express the row's layout ("" if it can)."""
    if len(row.stages) == 1:
        return ""  # data parallelism over groups, one dp rank (tp devices) per node
    if any(len(set(gpus)) > 1 for gpus, _ in row.stages):
        return "a pipeline stage's dp replicas on different GPU types"
    if len({len(gpus) for gpus, _ in row.stages}) > 1 or len({tp for _, tp in row.stages}) > 1:
        return "stages of different dp x tp"
    return ""


SPLIT_ORDER = ("N2_D1", "N3_D1", "N4_D1", "N2_D2", "N4_D4", "N6_D6")
"""Representable rows in the order they became so (the pipelines, then the dp rows), each
group in file-name order: the split alternates down this list."""


def transformer_split(layers: tuple[int, ...]) -> str:
    """Sailor counts the embedding as the first stage's layer and the head as the last's."""
    counts = list(layers)
    counts[0] -= 1
    counts[-1] -= 1
    return ":".join(map(str, counts))


def evaluate(row: Row) -> float:
    """Predicted seconds per iteration of the row's layout on its cluster."""
    model = opt_350m()
    dp = len(row.stages[0][0])
    tp = row.stages[0][1]
    if len(row.stages) == 1:
        # Data parallelism: one node per dp replica, its tp GPUs; equal shares (Sailor's plans
        # give one batch per replica); the gradient all-reduce crosses every node pair's link.
        names = list(row.stages[0][0])
        groups = tuple(Group(name=f"replica{r} {gpu}", cluster=group_cluster(gpu, tp), nodes=1)
                       for r, gpu in enumerate(names))
        between = min(node_link_bps(a, b) for i, a in enumerate(names) for b in names[i + 1:]) / tp / GB
        plan = Plan(dp=dp, tp=tp, microbatches=row.global_batch // (dp * row.mbs))
    else:
        used = dp * tp  # one node per stage: its GPUs hold the stage's dp x tp ranks
        groups = tuple(Group(name=f"stage{s} {gpus[0]}", cluster=group_cluster(gpus[0], used), nodes=1)
                       for s, (gpus, _) in enumerate(row.stages))
        names = [gpus[0] for gpus, _ in row.stages]
        between = min(node_link_bps(a, b) for a, b in zip(names, names[1:])) / used / GB
        plan = Plan(dp=dp, tp=tp, pp=len(row.stages), microbatches=row.global_batch // (dp * row.mbs),
                    schedule="1f1b", split=transformer_split(row.layers))
    mixed = MixedCluster(name=f"sailor-mit-{row.label}", groups=groups, between_bw_gbs=between, between_latency_us=50.0)
    priced = evaluate_mixed_plan(model, mixed, model.max_seq_len, row.global_batch, plan.validate(),
                                 lambda c: OPTIONS)
    return priced.step_time_s


def split_halves(rows: list[Row]) -> dict[str, str]:
    """The rule fixed before each row was first evaluated (module docstring): alternating down
    SPLIT_ORDER, visible first."""
    kept = {r.label for r in rows if not representable(r)}
    assert kept == set(SPLIT_ORDER), "a newly representable row: append it to SPLIT_ORDER before running it"
    return {label: ("visible" if i % 2 == 0 else "hold-out") for i, label in enumerate(SPLIT_ORDER)}


def _amp_rows():
    """AMP's rows (benchmarks/published_mixed_amp.py) as (label, half, measured, predict, layout, why)."""
    halves = amp.split_halves()
    for row in amp.ROWS:
        layout = f"mbs{row.mbs} tp{row.tp} dp{row.dp} pp{row.pp}" + (
            f" split {':'.join(map(str, amp.transformer_split(row)))}" if row.pp > 1 else "")
        yield row.label, halves.get(row.label, "-"), row.measured_s, (lambda r=row: amp.evaluate(r)), layout, \
            amp.representable(row)


def _sailor_rows():
    halves = split_halves(ROWS)
    for row in ROWS:
        layout = " | ".join(f"{'+'.join(g)} tp{tp}" for g, tp in row.stages)
        yield row.label, halves.get(row.label, "-"), row.measured_s, (lambda r=row: evaluate(r)), layout, \
            representable(row)


SOURCES = (("Sailor, MIT cluster (RTX 3090 / Titan RTX / RTX 2080 Ti nodes, OPT-350M)", _sailor_rows),
           ("AMP, 3 x p3.8xlarge V100 + 1 x g4dn.12xlarge T4 (GPT-2 345M)", _amp_rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true",
                        help="write the hold-out half's median (both sources) into phalanx/planner/validation.json "
                             "(key 'mixed')")
    parser.add_argument("--visible-only", action="store_true",
                        help="print the visible half only (what a modelling decision may look at)")
    args = parser.parse_args()
    if args.record and args.visible_only:
        parser.error("--record writes the hold-out half's median: drop --visible-only")
    halves_shown = ("visible",) if args.visible_only else ("visible", "hold-out")
    pooled: dict[str, list[float]] = {"visible": [], "hold-out": []}
    for title, rows in SOURCES:
        print(f"== {title}")
        print(f"{'run':7} {'half':9} {'measured s':>10} {'predicted s':>11} {'error':>7}  layout")
        errors: dict[str, list[float]] = {"visible": [], "hold-out": []}
        for label, half, measured, predict, layout, why in rows():
            if why:
                if not args.visible_only:
                    print(f"{label:7} {'-':9} {measured:10.2f} {'-':>11} {'-':>7}  {layout}  [not representable: {why}]")
                continue
            if half not in halves_shown:
                continue
            predicted = predict()
            err = (predicted - measured) / measured
            errors[half].append(abs(err))
            print(f"{label:7} {half:9} {measured:10.2f} {predicted:11.2f} {err:+7.1%}  {layout}")
        for half in halves_shown:
            values = errors[half]
            pooled[half] += values
            print(f"median |error|, {half} half: {statistics.median(values):.1%} over {len(values)} rows")
    print("== both sources")
    for half in halves_shown:
        print(f"median |error|, {half} half: {statistics.median(pooled[half]):.1%} over {len(pooled[half])} rows")
    if args.record:
        # Imported when run, not at the top: only --record writes the file.
        from phalanx.planner.validation import record

        record("mixed", statistics.median(pooled["hold-out"]), len(pooled["hold-out"]),
               source="benchmarks/planner_published_mixed.py --record: median |error| of predicted against measured "
                      "step time over the hold-out halves of Sailor's mixed-GPU runs (OPT-350M on RTX-3090, Titan RTX "
                      "and RTX 2080 Ti nodes) and AMP's (GPT-2 345M on V100 and T4 nodes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
