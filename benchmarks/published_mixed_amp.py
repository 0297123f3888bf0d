"""AMP's measured runs on a mixed V100 + T4 cluster, for benchmarks/planner_published_mixed.py.

Source: AMP (Li et al., NeurIPS 2022), https://github.com/DachengLi1/AMP (commit 72eeea4),
src/results/het_cluster_results.txt: 53 layouts of GPT-2 (hidden 1,024, 24 layers, 16 heads,
sequence 1,024, vocabulary 52,256; global batch 32) that AMP's search ranked, each run for
real ("r_cost": seconds per iteration, the mean of iterations 20-40, megatron/training.py)
on 3 AWS p3.8xlarge nodes (4 V100 SXM2 16 GB each, NVLink) and 1 g4dn.12xlarge (4 T4 16 GB,
PCIe), with Megatron-LM 1.1.5 on DeepSpeed's PipelineEngine: fp16 (ds_pretrain_gpt2_pipe.sh
passes --fp16), gradients all-reduced in fp32 (ds_config.json "fp32_allreduce") after the
last micro-batch, not overlapped (the engine's ReduceGrads instruction), stage outputs sent
partitioned over the model-parallel group (engine.py: is_pipe_partitioned), Megatron's fused
scale-mask-softmax, no activation checkpointing. Each row: micro-batch size, tensor- (AMP's
mp), data- and pipeline-parallel degrees, AMP's partition (boundaries over its 30 layer units:
embedding, a no-op, 24 transformer layers, two no-ops, the output embedding, a no-op) and the
measured seconds; 'inf' rows did not run and are left out.

The cluster as AMP states it (src/het_cluster.py, cluster_info, bits/s): p3.8xlarge nodes
10 Gb/s between nodes, 170 Gb/s inside (NVLink); the g4dn.12xlarge 50 Gb/s between and 50
inside (PCIe); two nodes meet at the slower of their links. The g4dn is the last node (ranks
12-15: cluster_info gives node N-1 its figures, and the cost model weighs its profile 1/4).
DeepSpeed's topology puts pipe outermost, model innermost: stage s holds ranks
s*dp*mp .. (s+1)*dp*mp - 1. Datasheets: NVIDIA Tesla V100 (SXM2: 125 TFLOP/s fp16 tensor,
80 SMs, 16 GB HBM2 at 900 GB/s, 300 W); NVIDIA T4 (65 TFLOP/s fp16 tensor, 40 SMs, 16 GB
GDDR6 at 320 GB/s, 70 W).

What the framework costs beyond FLOPs and bytes, measured by AMP on these machines: its
profiles (src/known_cost/gpt2_{P3,G4}_{1,2,4}.npy, forward seconds per layer unit at one
sequence, from ds_pretrain_gpt2_profile.sh) time a transformer layer's forward at 3.9-5.2 ms
on a V100 and 5.5-6.0 ms on a T4 whatever the model-parallel degree, where its FLOPs, bytes
and all-reduces take 0.8-1.8 ms (the cost model's own layer, at 1 to 4 ways): a fixed time
per layer per pass, the launches and Python of Megatron 1.1.5 and DeepSpeed on these hosts,
which the GPU presets do not carry. `framework_costs` takes it from those profiles:
`layer_overhead_us` the gap at mp=1, `tp_layer_overhead_us` what mp=2 and 4 add on average.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.model.config import ModelConfig
from phalanx.plan import Plan
from phalanx.planner import comm
from phalanx.planner.framework_costs import FrameworkCosts
from phalanx.planner.hardware import Cluster
from phalanx.planner.mixed_cluster import Group, MixedCluster
from phalanx.planner.mixed_search import evaluate_mixed_plan
from phalanx.planner.options import Options

GB = 1e9
GBIT = 1e9 / 8
NODE_GPUS = 4
V100 = dict(peak_tflops=125.0, sm_count=80, memory_gib=16.0, hbm_tbs=0.900, busy_w=300.0)
T4 = dict(peak_tflops=65.0, sm_count=40, memory_gib=16.0, hbm_tbs=0.320, busy_w=70.0)
P3_LINKS = (10 * GBIT, 170 * GBIT)
"""(between nodes, inside a node), bytes/s (het_cluster.py's cluster_info)."""
G4_LINKS = (50 * GBIT, 50 * GBIT)
P3_NODES = 3

PROFILED_FORWARD_MS = {"V100": {1: 3.919, 2: 5.243, 4: 4.519}, "T4": {1: 5.470, 2: 5.962, 4: 5.577}}
"""Mean over the 24 transformer units of AMP's known_cost profiles (forward, one sequence of
1,024 tokens), by model-parallel degree."""

OPTIONS = Options(flash_attention=False, pp_partitioned_sends=True, dp_overlap=False, grad_reduce_bytes=4)


def gpt2() -> ModelConfig:
    return ModelConfig(name="gpt2-amp", vocab_size=52256, dim=1024, n_layers=24, n_heads=16, n_kv_heads=16,
                       ffn_dim=4096, mlp="gelu", max_seq_len=1024)


@dataclass(frozen=True)
class AmpRow:
    label: str
    mbs: int
    tp: int
    dp: int
    pp: int
    partition: tuple[int, ...]
    measured_s: float
    global_batch: int = 32


_RAW = [  # (mbs, mp, dp, pp, partition, r_cost) in the results file's order
    (1, 1, 4, 4, [0, 7, 14, 20, 30], 1.47), (1, 1, 2, 8, [0, 5, 9, 12, 15, 18, 21, 24, 30], 1.28),
    (1, 1, 1, 16, [0, 3, 5, 7, 9, 11, 13, 15, 16, 17, 19, 20, 21, 22, 23, 25, 30], 1.52),
    (2, 1, 4, 4, [0, 7, 14, 20, 30], 1.53), (2, 1, 2, 8, [0, 5, 9, 12, 14, 17, 20, 23, 30], 1.54),
    (2, 1, 1, 16, [0, 3, 5, 7, 9, 11, 13, 14, 16, 18, 19, 20, 21, 23, 24, 25, 30], 1.58),
    (4, 1, 4, 4, [0, 6, 13, 20, 30], 1.71), (1, 1, 8, 2, [0, 14, 30], 2.23), (1, 2, 2, 4, [0, 8, 14, 20, 30], 2.8),
    (4, 1, 2, 8, [0, 3, 7, 11, 14, 17, 20, 23, 30], 1.71),
    (4, 1, 1, 16, [0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 30], float("inf")),
    (1, 2, 1, 8, [0, 5, 8, 11, 14, 17, 20, 23, 30], 3.81), (2, 1, 8, 2, [0, 14, 30], 2.26),
    (1, 2, 4, 2, [0, 14, 30], 2.89), (2, 2, 2, 4, [0, 8, 14, 20, 30], 2.37), (4, 1, 8, 2, [0, 14, 30], 2.34),
    (2, 2, 1, 8, [0, 5, 8, 11, 14, 17, 20, 23, 30], 3.36), (2, 2, 4, 2, [0, 14, 30], 2.5),
    (1, 2, 8, 1, [0, 30], 3.13), (2, 2, 8, 1, [0, 30], 3.06), (4, 2, 8, 1, [0, 30], 3.03), (1, 1, 16, 1, [0, 30], 2.9),
    (2, 1, 16, 1, [0, 30], float("inf")), (8, 1, 4, 4, [0, 8, 14, 20, 30], 2.07), (4, 2, 4, 2, [0, 14, 30], 2.41),
    (4, 2, 2, 4, [0, 8, 14, 20, 30], 1.65), (8, 1, 2, 8, [0, 1, 3, 7, 11, 15, 19, 23, 30], float("inf")),
    (1, 4, 2, 2, [0, 14, 30], float("inf")), (4, 2, 1, 8, [0, 5, 8, 11, 14, 17, 20, 23, 30], 1.79),
    (1, 4, 1, 4, [0, 8, 14, 20, 30], float("inf")), (1, 4, 4, 1, [0, 30], 3.8), (2, 4, 4, 1, [0, 30], 3.56),
    (4, 4, 4, 1, [0, 30], 3.29), (8, 4, 4, 1, [0, 30], 3.27),
    (8, 1, 1, 16, [0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 30], float("inf")),
    (2, 4, 2, 2, [0, 14, 30], 3.29), (2, 4, 1, 4, [0, 8, 14, 20, 30], 3.92), (4, 4, 2, 2, [0, 14, 30], 2.66),
    (8, 2, 4, 2, [0, 14, 30], 2.45), (4, 4, 1, 4, [0, 8, 14, 20, 30], 2.05), (8, 2, 2, 4, [0, 8, 14, 20, 30], 1.91),
    (8, 4, 2, 2, [0, 14, 30], 2.71), (8, 2, 1, 8, [0, 5, 8, 11, 14, 17, 20, 23, 30], 2.12),
    (8, 4, 1, 4, [0, 8, 14, 20, 30], 2.13), (16, 1, 2, 8, [0, 5, 8, 11, 14, 17, 20, 23, 30], float("inf")),
    (16, 1, 1, 16, [0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 30], float("inf")),
    (16, 4, 2, 2, [0, 14, 30], 2.66), (16, 2, 2, 4, [0, 8, 14, 20, 30], 2.33), (16, 4, 1, 4, [0, 8, 14, 20, 30], 2.49),
    (16, 2, 1, 8, [0, 5, 8, 11, 14, 17, 20, 23, 30], 2.69),
    (32, 1, 1, 16, [0, 4, 6, 8, 10, 12, 14, 16, 18, 19, 20, 21, 22, 23, 24, 25, 30], float("inf")),
    (32, 4, 1, 4, [0, 8, 14, 20, 30], 3.13), (32, 2, 1, 8, [0, 5, 8, 11, 14, 17, 20, 23, 30], float("inf")),
]
ROWS = [AmpRow(label=f"amp{i:02d}", mbs=mbs, tp=mp, dp=dp, pp=pp, partition=tuple(part), measured_s=cost)
        for i, (mbs, mp, dp, pp, part, cost) in enumerate(_RAW)]

FIRST_LAYER_UNIT = 2
"""AMP's units: [embedding, no-op, 24 transformer layers, no-op, no-op, output embedding, no-op]."""


def transformer_split(row: AmpRow, n_layers: int = 24) -> list[int]:
    """Transformer layers per stage from AMP's unit boundaries."""
    first, last = FIRST_LAYER_UNIT, FIRST_LAYER_UNIT + n_layers
    return [max(0, min(b, last) - max(a, first)) for a, b in zip(row.partition, row.partition[1:])]


def gpu_of_rank(rank: int) -> str:
    return "V100" if rank < P3_NODES * NODE_GPUS else "T4"


def representable(row: AmpRow) -> str:
    """Why the mixed planner cannot express the row ("" if it can), from its layout alone."""
    if row.measured_s == float("inf"):
        return "did not run (AMP's r_cost inf)"
    per_stage = row.dp * row.tp
    if row.pp > 1:
        if any(len({gpu_of_rank(r) for r in range(s * per_stage, (s + 1) * per_stage)}) > 1 for s in range(row.pp)):
            return "a pipeline stage on both GPU types"
        if min(transformer_split(row)) < 1:
            return "a pipeline stage with no transformer layer"
        if row.global_batch // (row.dp * row.mbs) < row.pp:
            return "fewer micro-batches than stages (1f1b as phalanx runs it needs microbatches >= pp)"
    return ""


def split_halves() -> dict[str, str]:
    """Fixed before any row was first evaluated: the representable rows in the results file's
    order (AMP's predicted rank), alternating visible (the only half a modelling decision may
    look at) and hold-out."""
    kept = [r.label for r in ROWS if not representable(r)]
    return {label: ("visible" if i % 2 == 0 else "hold-out") for i, label in enumerate(kept)}


def _cluster(gpu: str, inter_bps: float, intra_bps: float, sharing: int, framework: FrameworkCosts = FrameworkCosts()
             ) -> Cluster:
    """One node type; its network link shared by the `sharing` devices that use it at once."""
    return Cluster(name=gpu.lower(), devices_per_node=NODE_GPUS, fast_domain=NODE_GPUS, **(V100 if gpu == "V100" else T4),
                   intra_bw_gbs=intra_bps / GB, inter_bw_gbs=inter_bps / sharing / GB, intra_latency_us=10.0,
                   inter_latency_us=50.0, framework=framework)


def modelled_forward_s(gpu: str, tp: int) -> float:
    """The cost model's forward of one transformer layer, one sequence, `tp` ways on one node
    of `gpu` (FLOPs, bytes and the two tp all-reduces), no framework cost."""
    # Imported when run, not at the top: stage_time is the cost model's inside, used only here.
    from phalanx.planner.stage_time import layer_cost

    cluster = _cluster(gpu, P3_LINKS[0], (P3_LINKS if gpu == "V100" else G4_LINKS)[1], NODE_GPUS)
    model = gpt2()
    lc = layer_cost(model, cluster, seq=model.max_seq_len, mbs=1, tp=tp, ep=1, sp=False, moe=False,
                    peak=cluster.peak_tflops * 1e12, flash=OPTIONS.flash_attention,
                    memory_bw=cluster.hbm_tbs * 1e12 * cluster.hbm_efficiency, overhead=0.0)
    return lc.f + 2 * comm.all_reduce(cluster, lc.tp_bytes, size=tp, stride=1)


def framework_costs(gpu: str) -> FrameworkCosts:
    """AMP's profiled forward per layer less the cost model's (module docstring)."""
    gap = {tp: PROFILED_FORWARD_MS[gpu][tp] * 1e-3 - modelled_forward_s(gpu, tp) for tp in (1, 2, 4)}
    return FrameworkCosts(layer_overhead_us=gap[1] * 1e6, tp_layer_overhead_us=((gap[2] + gap[4]) / 2 - gap[1]) * 1e6)


def evaluate(row: AmpRow) -> float:
    """Predicted seconds per iteration of the row's layout."""
    model = gpt2()
    between = min(P3_LINKS[0], G4_LINKS[0])
    # Pipelines: a stage's dp x tp devices send across a node boundary at once; dp: every
    # device of a node takes part in the all-reduce over nodes.
    sharing = min(NODE_GPUS, row.dp * row.tp) if row.pp > 1 else NODE_GPUS
    groups = (Group(name="p3.8xlarge V100", cluster=_cluster("V100", min(P3_LINKS[0], between), P3_LINKS[1], sharing,
                                                             framework_costs("V100")), nodes=P3_NODES),
              Group(name="g4dn.12xlarge T4", cluster=_cluster("T4", between, G4_LINKS[1], sharing, framework_costs("T4")),
                    nodes=1))
    mixed = MixedCluster(name="amp-het", groups=groups, between_bw_gbs=between / sharing / GB, between_latency_us=50.0)
    m = row.global_batch // (row.dp * row.mbs)
    if row.pp == 1:
        plan = Plan(dp=row.dp, tp=row.tp, microbatches=m)
    else:
        plan = Plan(dp=row.dp, tp=row.tp, pp=row.pp, microbatches=m, schedule="1f1b",
                    split=":".join(map(str, transformer_split(row))))
    return evaluate_mixed_plan(model, mixed, model.max_seq_len, row.global_batch, plan.validate(),
                               lambda c: OPTIONS).step_time_s
