"""Predicted step time and memory of one layout: compute, communication, bubbles, memory.

One micro-batch through the most loaded stage (its layers' compute, TP and EP communication,
recompute, logits and loss) is stage_time.py's; this adds the rest of the step:
Communication per step beyond the stage's layers (comm.py for the alpha-beta times):
  PP: one T h / tp (sp, or partitioned sends) or T h send per stage boundary each way per micro-batch.
  DP: gradient all-reduce (zero 0) or reduce-scatter + parameter all-gather (zero 1, 2) once
    per step in 25 MiB buckets (zero 2: one collective per FSDP unit), overlapped with the
    last backward / first forward when `dp_overlap`; zero 3 gathers parameters forward and
    backward every micro-batch and reduce-scatters the gradients
    once per step, one collective per layer. Reduce-scatter and all-gather are rings, their
    latency one hop per member (comm.py). On a CPU (shared_compute) gloo uses the cores that
    compute, so nothing overlaps.
Step = m x (F + B + W + recompute) on the most loaded stage + bubble + exposed sends +
  exposed DP traffic + the optimizer step (memory-bound: Adam's 30 bytes and clipping's 12 per
  parameter of the local optimizer shard, 4 to zero each gradient-buffer element) +
  the cluster's fixed `step_overhead_ms` and `optimizer_layer_overhead_us` per layer on the
  stage (measured on CPUs, zero on the GPU presets).
Bubbles, with stage times F, B, W of one micro-batch: gpipe, 1f1b (p-1)(F+B+W); interleaved
  (p-1)(F+B+W)/v (published-figures.md section 3); zbv and dualpipev timed on their own
  orders of operations (pipeline_orders.v_bubble), the simulator's timeline without sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx import layout_rules as rules
from phalanx.errors import UserError
from phalanx.model.config import ModelConfig
from phalanx.planner import comm, latent_attention
from phalanx.planner.memo import by_identity as _by_identity
from phalanx.planner.dp_traffic import dp_time, replica_sum_time
from phalanx.planner.hardware import Cluster
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.memory import layers_per_stage
from phalanx.planner.options import Options, activation_bytes
from phalanx.planner.peak_memory import (
    BF16,
    expert_shards,
    moe_layer_count,
    peak_memory,
    recompute_share,
    stage_params,
)
from phalanx.planner.pipeline_orders import v_bubble
from phalanx.planner.stage_time import StageTimes, layer_costs, stage_cost

OPTIMIZER_BYTES_PER_PARAM = 30
"""Adam reads fp32 param, grad and two moments (16 bytes), writes three and a bf16 copy (14)."""
CLIP_BYTES_PER_PARAM = 12
"""Gradient-norm clipping: read the fp32 gradient for the norm (4), read and write it scaled (8)."""
GRAD_ZERO_BYTES_PER_PARAM = 4
"""Zeroing the fp32 gradient-accumulation buffer before the next step (written once)."""
BREAKDOWN_KEYS = ("compute", "recompute", "tp_comm", "ep_comm", "cp_comm", "pp_comm", "bubble", "dp_comm",
                  "optimizer", "overhead")


@dataclass(frozen=True, kw_only=True)
class Estimate:
    layout: Layout
    step_time_s: float
    breakdown: dict[str, float]
    memory_bytes: float
    memory_breakdown: dict[str, float]
    host_breakdown: dict[str, float] = field(default_factory=dict)
    """Bytes offload=true keeps on the host (not in memory_bytes)."""
    fits: bool
    model_flops: float
    """Per step over all devices, Megatron's convention: 3 passes, full attention matrix, no recompute."""
    hardware_flops: float
    """model_flops plus the recomputed forward."""
    world_size: int
    peak_flops: float
    tokens: int
    seq_len: int
    hidden_size: int
    stage: StageTimes = field(repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time_s / self.world_size / 1e12

    @property
    def hw_tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.step_time_s / self.world_size / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time_s * self.world_size * self.peak_flops)

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30


def layer_flops(model: ModelConfig, *, seq: int, moe: bool) -> tuple[float, float]:
    """(GEMM, attention-core) forward FLOPs of one layer for one sequence, Megatron's counting."""
    h, hq, hkv = model.dim, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    params = latent_attention.attention_params(model) if model.is_latent else 2 * h * hq + 2 * h * hkv
    if moe:
        fe = model.moe_ffn_dim
        params += h * model.n_experts + 3 * h * fe * (model.experts_per_token + model.n_shared_experts)
    else:
        params += (3 if model.mlp == "swiglu" else 2) * h * model.ffn_dim
    return 2.0 * seq * params, 4.0 * seq * seq * latent_attention.core_width(model)


@_by_identity
def step_flops(model: ModelConfig, workload: Workload, recompute: str) -> tuple[float, float]:
    """(model, hardware) FLOPs of one step: 3 passes; hardware adds the recomputed forward."""
    s = workload.seq_len
    # Layers repeat: dense ones and MoE ones each cost the same, so count them, not loop over them.
    n_moe = model.n_moe_layers
    dense_gemm, dense_attn = layer_flops(model, seq=s, moe=False)
    moe_gemm, moe_attn = layer_flops(model, seq=s, moe=True) if n_moe else (0.0, 0.0)
    gemm_total = (model.n_layers - n_moe) * dense_gemm + n_moe * moe_gemm
    attn_total = (model.n_layers - n_moe) * dense_attn + n_moe * moe_attn
    logits = 2.0 * s * model.dim * model.vocab_size
    model_flops = 3 * workload.global_batch * (gemm_total + attn_total + logits)
    extra = {"none": 0.0, "selective": attn_total, "full": gemm_total + attn_total}[recompute]
    return model_flops, model_flops + workload.global_batch * extra


def problems(model: ModelConfig, workload: Workload, cluster: Cluster, layout: Layout, world_size: int) -> list[str]:
    """Why a layout cannot run this model, or an empty list."""
    out = []
    lay = layout
    if lay.world_size != world_size:
        out.append(f"dp={lay.dp} x cp={lay.cp} x tp={lay.tp} x pp={lay.pp} = {lay.world_size}, not {world_size} GPUs")
    for problem in (
            rules.tp_problem(lay.tp, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, ffn_dim=model.ffn_dim,
                             vocab_size=model.vocab_size, expert_ffn_dim=model.moe_ffn_dim,
                             n_experts=model.n_experts, padded=True),
            rules.ep_problem(lay.ep, dp=lay.dp if lay.ep_over_tp else lay.replicas, n_experts=model.n_experts, tp=lay.tp,
                             over_tp=lay.ep_over_tp),
            rules.cp_problem(lay.cp, seq_len=workload.seq_len, tp=lay.tp, sp=lay.sp),
            rules.cp_ring_problem(lay.cp_ring, latent=model.is_latent, model=model.name),
            "ep_over_tp=true with cp > 1 is not priced by the planner yet (the trainer runs it: give the plan by hand)" if lay.cp > 1 and lay.ep_over_tp else "",
            rules.pipeline_problem(lay.schedule, pp=lay.pp, virtual=lay.virtual, microbatches=lay.microbatches,
                                   n_layers=model.n_layers)):
        if problem:
            out.append(problem)
    if workload.global_batch != lay.dp * lay.mbs * lay.microbatches:
        out.append(f"dp={lay.dp} x mbs={lay.mbs} x microbatches={lay.microbatches} != global batch {workload.global_batch}")
    if lay.zero not in (0, 1, 2, 3):
        out.append(f"zero={lay.zero} must be 0, 1, 2 or 3")
    if lay.replicate > 1 and lay.zero != 3:
        out.append("replicate (HSDP) needs zero=3 (fsdp=true)")
    if lay.dp % lay.replicate:
        out.append(f"replicate={lay.replicate} must divide dp={lay.dp}")
    try:
        lay.plan.validate()
    except UserError as exc:  # the trainer's own rules, verbatim
        out.append(str(exc).removeprefix("invalid plan: "))
    return out


def evaluate(model: ModelConfig, cluster: Cluster, workload: Workload, layout: Layout,
             options: Options = Options()) -> Estimate:
    """Predicted step time, breakdown and peak memory of a (valid) layout."""
    lay = layout
    seq, m, p, v = workload.seq_len, lay.microbatches, lay.pp, lay.virtual
    world = lay.world_size
    memory_bw = cluster.memory_bw_per_rank(world)
    fw, queue = cluster.framework, cluster.queueing(world)
    tokens = lay.mbs * seq // lay.cp  # per rank: cp splits each sequence
    sc = stage_cost(model, cluster, workload, lay, options)
    stage, n, n_moe, rc_share = sc.times, sc.layers, sc.moe_layers, sc.recomputed_share
    per_mb = stage.f + stage.b + stage.w + stage.r

    bubble = _bubble(lay.schedule, p, v, stage, m)
    # Pipeline sends on the critical path: each micro-batch (per chunk) each way, plus fill/drain.
    if p > 1:
        boundary_bytes = tokens * model.dim * activation_bytes(options) / (lay.tp if lay.sp or options.pp_partitioned_sends else 1)
        same = lay.tp * lay.replicas * 2 <= cluster.fast_domain
        t_send = comm.send(cluster, boundary_bytes, same_domain=same)
        pp_comm = 2 * t_send * (m * v + p - 1)
        # The pipeline runtime's own cost per action beyond compute and bytes (CPUs, measured).
        pp_comm += m * actions_per_microbatch(lay.schedule, v) * cluster.framework.pp_action_s(lay.schedule) * cluster.queueing(world)
    else:
        pp_comm = 0.0

    c, shared_params, expert_params = stage_params(model, lay, n, n_moe, options)
    regathered = rc_share if lay.recompute == "full" and options.recompute_regathers else 0.0
    dp_comm = dp_time(cluster, lay, options, shared_params, expert_params, stage, n, regathered)
    dp_comm += replica_sum_time(cluster, model, lay, options.expert_slots, n_moe)
    shards = lay.replicas // lay.replicate
    local_state = shared_params / (shards if lay.zero else 1) + expert_params / (expert_shards(lay, shards) if lay.zero else 1)
    # The gradient buffer is whole under zero 0 and 1 (each rank accumulates all its gradients,
    # then reduce-scatters them), sharded like the optimizer state under zero 2 and 3.
    grad_buffer = local_state if lay.zero >= 2 else shared_params + expert_params
    optimizer = (local_state * (OPTIMIZER_BYTES_PER_PARAM + CLIP_BYTES_PER_PARAM)
                 + grad_buffer * GRAD_ZERO_BYTES_PER_PARAM) / memory_bw

    step_overhead = fw.step_overhead_ms * 1e-3 * queue
    optimizer_layer = cluster.framework.optimizer_layer_overhead_us + (cluster.framework.tp_optimizer_layer_overhead_us if lay.tp > 1 else 0.0)
    step_overhead += n * optimizer_layer * 1e-6 * cluster.queueing(world)
    step = m * per_mb + bubble + pp_comm + dp_comm + optimizer + step_overhead
    breakdown = {
        "compute": m * sc.compute,
        "recompute": m * sc.recompute,
        "tp_comm": m * sc.tp_comm,
        "ep_comm": m * sc.ep_comm,
        "cp_comm": m * sc.cp_comm,
        "pp_comm": pp_comm,
        "bubble": bubble,
        "dp_comm": dp_comm,
        "optimizer": optimizer,
        "overhead": step_overhead,
    }

    memory, host = peak_memory(model, workload, lay, options, n, n_moe, shared_params, expert_params, c)
    model_flops, hardware_flops = step_flops(model, workload, lay.recompute)
    return Estimate(
        layout=lay, step_time_s=step, breakdown=breakdown, memory_bytes=sum(memory.values()),
        memory_breakdown=memory, host_breakdown=host, fits=sum(memory.values()) <= cluster.usable_bytes,
        model_flops=model_flops, hardware_flops=hardware_flops, world_size=world,
        peak_flops=cluster.peak_flops_per_rank(world),
        tokens=workload.global_batch * seq, seq_len=seq, hidden_size=model.dim, stage=stage,
    )


def step_time_lower_bound(model: ModelConfig, cluster: Cluster, workload: Workload, layout: Layout,
                          options: Options = Options()) -> float:
    """Seconds no step of this layout can beat: the most loaded stage's layer compute (forward,
    input and weight gradients, and the recomputed forward) over its micro-batches, plus the
    bubble of the schedules whose bubble grows with that compute (gpipe, 1f1b, interleaved:
    (p-1)/v stage times), each a part of what `evaluate` sums, every other part being at
    least 0. Lets a search skip pricing layouts that cannot win."""
    lay = layout
    n = layers_per_stage(model.n_layers, lay.pp, lay.virtual)
    n_moe = min(n, moe_layer_count(model))
    dense, moe = layer_costs(model, cluster, workload, lay, options, overhead=0.0, moe=n_moe > 0)
    per_mb = (n - n_moe) * (dense.f + dense.b + dense.w) + n_moe * (moe.f + moe.b + moe.w)
    if lay.recompute == "full":
        per_mb += recompute_share(model, lay) * ((n - n_moe) * dense.f + n_moe * moe.f)
    bubble = 0.0
    if lay.pp > 1 and lay.schedule not in rules.V_SCHEDULES:
        bubble = (lay.pp - 1) * per_mb / (lay.virtual if lay.schedule == "interleaved" else 1)
    return lay.microbatches * per_mb + bubble


def _bubble(schedule: str, p: int, v: int, st: StageTimes, m: int = 0) -> float:
    """Idle seconds of a step beyond m x the stage time (m: micro-batches, needed by the V schedules)."""
    if p == 1:
        return 0.0
    full = st.f + st.b + st.w + st.r
    if schedule == "interleaved":
        return (p - 1) * full / v
    if schedule in rules.V_SCHEDULES:  # their own order of operations, timed (pipeline_orders.py)
        return v_bubble(schedule, p, m, st.f, st.b + st.r, st.w)
    return (p - 1) * full  # gpipe and 1f1b


def actions_per_microbatch(schedule: str, virtual: int) -> int:
    """Pipeline actions one rank runs per micro-batch: a forward and a backward per chunk, the
    V-shaped schedules' backward split in two (input gradient, then weight gradient)."""
    chunks = virtual if schedule in ("interleaved", "zbv", "dualpipev") else 1
    return chunks * (3 if schedule in ("zbv", "dualpipev") else 2)
