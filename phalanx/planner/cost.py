"""Predicted step time and memory of one layout: compute, communication, bubbles, memory.

Time of one micro-batch through one layer, per device (T = mbs * seq tokens):
  GEMMs: 2 m n k FLOPs each, at `matmul_efficiency` x f(m) f(n) f(k) of peak, where
    f(d) = d / (d + matmul_half_dim) charges small dimensions (h/tp, tokens per expert),
    times the wave fill: output tiles of 128 x 256 run `sm_count` at a time (wave_fill).
    Backward = input gradients (B) + weight gradients (W), each the forward's FLOPs on its own
    output shape (m x k for B, n x k for W).
  Attention core: 4 T s h_q / tp FLOPs forward, halved for the causal mask (flash kernels
    skip masked blocks), backward 2.5x forward, at `attention_efficiency` of peak. Without
    flash attention: the full s x s FLOPs (backward 2x), plus softmax (and GPT-style
    dropout) passes over the b a s^2 / tp 16-bit scores in HBM.
  Element-wise work (norms, activations, residuals, rotary): memory-bound, modelled as
    reading and writing the layer's stored activations once forward, twice backward, at
    `elementwise_efficiency` of the bandwidth (1 on GPUs, measured on the real layer on CPUs).
  `layer_overhead_us` per pass (launches, Python): zero on the GPU presets, measured on CPU,
    like the framework costs of tensor parallelism (`tp_layer_overhead_us`, per layer per
    pass), FSDP (`fsdp_unit_overhead_us`, per unit per micro-batch) and activation
    checkpointing (`recompute_overhead_us`, per layer per micro-batch).
Communication per layer per micro-batch (comm.py for the alpha-beta times):
  TP: 2 all-reduces of T h bf16 forward, 2 backward (with sp: all-gathers + reduce-scatters
    of the same bandwidth cost, plus, with `Options.sp_regather`, 2 all-gathers in backward to
    re-gather the inputs SP stores sharded); exposed, or pipelined with the GEMMs with `tp_overlap`.
  EP: dispatch + combine all-to-all of T k h / tp bf16 forward, the same backward; DualPipe
    (dualpipev) overlaps them with the other micro-batch's compute, as it was designed to.
  PP: one T h / tp (sp) or T h send per stage boundary each way per micro-batch.
  DP: gradient all-reduce (zero 0) or reduce-scatter + parameter all-gather (zero 1, 2) once
    per step in 25 MiB buckets (zero 2: one collective per FSDP unit), overlapped with the
    last backward / first forward when `dp_overlap`; zero 3 gathers parameters forward and
    backward every micro-batch and reduce-scatters the gradients
    once per step, one collective per layer. Reduce-scatter and all-gather are rings, their
    latency one hop per member (comm.py). On a CPU (shared_compute) gloo uses the cores that
    compute, so nothing overlaps.
Full recompute under zbv re-runs each block's forward once more per weight tensor, in the
  W slots (Options.split_backward_recompute: PyTorch's split backward).
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

import functools
import math
from dataclasses import dataclass, field

from phalanx import layout_rules as rules
from phalanx.model.config import ModelConfig
from phalanx.planner import comm
from phalanx.planner.dp_traffic import by_identity as _by_identity
from phalanx.planner.dp_traffic import collective_time as _collective
from phalanx.planner.dp_traffic import dp_time
from phalanx.planner.hardware import Cluster
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.memory import MIXED_ADAM, Precision, layer_activation_bytes, layers_per_stage
from phalanx.planner.peak_memory import (  # noqa: F401 (BF16, memory_breakdown: re-exported)
    BF16,
    memory_breakdown,
    moe_layer_count,
    peak_memory,
    recompute_share,
    stage_params,
)
from phalanx.planner.pipeline_orders import v_bubble

OPTIMIZER_BYTES_PER_PARAM = 30
"""Adam reads fp32 param, grad and two moments (16 bytes), writes three and a bf16 copy (14)."""
CLIP_BYTES_PER_PARAM = 12
"""Gradient-norm clipping: read the fp32 gradient for the norm (4), read and write it scaled (8)."""
GRAD_ZERO_BYTES_PER_PARAM = 4
"""Zeroing the fp32 gradient-accumulation buffer before the next step (written once)."""
LOSS_BYTES_F = 22
"""HBM bytes per logit element of cross-entropy on fp32 logits (the trainer's
F.cross_entropy(logits.float())), forward: the cast reads bf16 and writes fp32 (2 + 4);
log-softmax over a row too long for shared memory reads it for the maximum, again for the
sum of exponentials, and a third time to write the result (3 x 4 + 4)."""
LOSS_BYTES_B = 26
"""Backward: the loss gradient is written dense (4); log-softmax backward reads it for its
sum, then reads it and the saved output and writes the input gradient (4 + 12); the cast
back to bf16 reads fp32 and writes bf16 (4 + 2)."""
BREAKDOWN_KEYS = ("compute", "recompute", "tp_comm", "ep_comm", "pp_comm", "bubble", "dp_comm", "optimizer",
                  "overhead")


@dataclass(frozen=True, kw_only=True)
class Options:
    """Properties of the training implementation rather than of the layout or the cluster."""

    flash_attention: bool = True
    """Fused attention: no s x s score matrix is stored."""
    tp_overlap: bool = False
    """TP collectives pipelined with their GEMMs (Megatron's tp-comm-overlap); phalanx does not."""
    dp_overlap: bool = True
    """Data-parallel traffic overlapped with the last backward and the first forward."""
    grad_reduce_bytes: int = 4
    """Gradients are reduced in fp32."""
    split_backward_recompute: bool = True
    """Under zbv (PyTorch's stage_backward_input, then stage_backward_weight) a checkpointed
    block's forward runs again for the input gradient and once more for each of its weight
    tensors' gradients: every weight gradient is a separate autograd call and checkpointing
    frees what it recomputed after each (measured: a dense SwiGLU block, 9 weight tensors, ran
    its forward 11 times per micro-batch; a tiny-model zbv step went from 62 to 174 ms with
    recompute=full, 1f1b from 32 to 54 ms). dualpipev runs measured no such cost, so it is
    charged to zbv only."""
    recompute_regathers: bool = False
    """Under zero 3, the recompute forward all-gathers the checkpointed layers' parameters once
    more (DeepSpeed ZeRO-3, whose hooks sit on every submodule). False: FSDP2 around the
    checkpointed block (phalanx's order, parallel/apply.py; torchtitan's) re-runs the forward
    inside the unit's backward, after its gather: with torch 2.13, 3 checkpointed blocks on 2
    processes gather 6 times per step with recompute as without
    (tests/test_planner_fsdp_gathers.py counts them)."""
    sp_regather: bool = False
    """Sequence parallelism keeps the attention and MLP inputs sharded and all-gathers them again
    in backward for the weight gradients (Megatron, and the published activation formula).
    False: it keeps the gathered inputs whole, more memory and no second gather (phalanx's
    DTensor sequence parallelism)."""
    precision: Precision = MIXED_ADAM
    """Bytes of weights, gradients, optimizer state, activations and logits
    (`memory.TRAINER_PRECISION[dtype]` for the phalanx trainer)."""
    fused_norm: bool = True
    """RMSNorm runs as one kernel that saves only its input and 1/rms per row (torch's
    `_fused_rms_norm` on CUDA; Apex and Transformer Engine likewise). False: torch's CPU
    `rms_norm`, a composite of pow, mean, rsqrt and two multiplies, whose weight multiply also
    saves the normalized x/rms, one more s x b x h tensor per norm (benchmarks/activation_probe.py)."""
    phalanx_trainer: bool = False
    """What phalanx's model and trainer keep beyond the reference implementations of the
    published runs (each measured or read off PyTorch, see `memory.layer_activation_bytes` and
    peak_memory.py): k and v repeated to every query head before attention and saved so; the
    MoE combine's `index_add` saving its weighted rows; torch DDP's reducer buckets, a second
    copy of the gradients (`gradient_as_bucket_view=False`)."""


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One layer, one micro-batch, one device: seconds per part, and bytes it communicates."""

    f: float
    b: float
    w: float
    attention_f: float
    tp_bytes: float
    ep_bytes: float
    gemm_f: float


@dataclass(frozen=True, kw_only=True)
class StageTimes:
    """One micro-batch through the most loaded stage, communication included."""

    f: float
    b: float
    w: float
    r: float
    """Recompute before backward."""
    f_comm: float = 0.0
    """Of f, exposed TP + EP communication (the rest is compute)."""
    b_comm: float = 0.0
    r_comm: float = 0.0


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


def _fill(d: float, half: float) -> float:
    return d / (d + half)


GEMM_TILE = (128, 256)
"""Output tile of the large bf16 GEMM kernels on A100/H100/B200 (cuBLAS, CUTLASS), either way round."""


def wave_fill(m: float, n: float, sm_count: int) -> float:
    """Fraction of the SMs' time an (m x n) output keeps busy when its tiles run in waves.

    ceil(m/128) ceil(n/256) tiles (or the transposed tile, whichever fills better) run
    sm_count at a time; the last wave leaves SMs idle. E.g. 16384 x 6144 on 132 SMs: 3072
    tiles in 24 waves of 132, 3072 / 3168 = 0.97. Libraries also pick smaller tiles or
    split K for shapes that fill badly, so this is the loss of the large-tile kernel.
    """
    if sm_count <= 0:
        return 1.0
    best = 0.0
    for tm, tn in (GEMM_TILE, GEMM_TILE[::-1]):
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        best = max(best, tiles / (math.ceil(tiles / sm_count) * sm_count))
    return best


def gemm_time(m: float, n: float, k: float, *, cluster: Cluster, peak: float) -> float:
    """Seconds for an (m x k) @ (k x n) product at the size-dependent efficiency."""
    half = cluster.matmul_half_dim
    eff = cluster.matmul_efficiency * _fill(m, half) * _fill(n, half) * _fill(k, half)
    eff *= wave_fill(m, n, cluster.sm_count)
    return 2.0 * m * n * k / (peak * eff)


@_by_identity
def layer_cost(model: ModelConfig, cluster: Cluster, *, seq: int, mbs: int, tp: int, ep: int, sp: bool,
               moe: bool, peak: float, flash: bool, memory_bw: float, overhead: float) -> LayerCost:
    """Forward, input-gradient and weight-gradient seconds of one layer for one micro-batch."""
    tokens = mbs * seq
    h, hq, hkv = model.dim, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    one = functools.partial(gemm_time, cluster=cluster, peak=peak)

    def g(m: float, n: float, k: float) -> tuple[float, float, float]:
        # Forward (m x k)(k x n); input gradient (m x n)(n x k); weight gradient (n x m)(m x k):
        # the same FLOPs, different output shapes, hence different wave fill.
        return one(m, n, k), one(m, k, n), one(n, k, m)

    parts = [g(tokens, (hq + 2 * hkv) / tp, h), g(tokens, h, hq / tp)]
    if moe:
        k, fe = model.experts_per_token, model.moe_ffn_dim
        parts.append(g(tokens, model.n_experts, h))
        per_expert = tokens * k * ep / model.n_experts  # tokens each local expert sees
        local = model.n_experts / ep  # experts on this device, one GEMM each
        for p in [g(per_expert, fe / tp, h)] * 2 + [g(per_expert, h, fe / tp)]:
            parts.append(tuple(local * t for t in p))
        if model.n_shared_experts:
            fs = fe * model.n_shared_experts
            parts += [g(tokens, fs / tp, h)] * 2 + [g(tokens, h, fs / tp)]
    elif model.mlp == "swiglu":
        parts += [g(tokens, model.ffn_dim / tp, h)] * 2 + [g(tokens, h, model.ffn_dim / tp)]
    else:
        parts += [g(tokens, model.ffn_dim / tp, h), g(tokens, h, model.ffn_dim / tp)]
    gemm, gemm_b, gemm_w = (sum(p[i] for p in parts) for i in range(3))
    stored = layer_activation_bytes(model, seq=seq, mbs=mbs, tp=tp, sp=sp, recompute="none", moe=moe, flash=True)
    elementwise = 2 * stored / (memory_bw * cluster.elementwise_efficiency)
    if flash:  # fused kernel: masked blocks skipped, scores never leave the chip
        attention = 0.5 * 4 * tokens * seq * hq / tp / (peak * cluster.attention_efficiency)
        attention_b = 2.5 * attention
    else:
        # Two batched GEMMs over the whole s x s score matrix (the mask is applied after them),
        # backward twice the forward's FLOPs; between them the scores go through HBM: fused
        # scale-mask-softmax reads and writes 16-bit scores (4 bytes per score forward, 6 backward:
        # gradient and probabilities in, gradient out), GPT-style dropout on the probabilities
        # 5 more each way (2 in, 2 out, a 1-byte mask).
        attention = 4 * tokens * seq * hq / tp / (peak * cluster.attention_efficiency)
        attention_b = 2 * attention
        scores = mbs * model.n_heads * seq * seq / tp
        dropout = 5 if model.mlp == "gelu" else 0
        attention += scores * (4 + dropout) / memory_bw
        attention_b += scores * (6 + dropout) / memory_bw
    return LayerCost(
        f=gemm + attention + elementwise + overhead,
        b=gemm_b + attention_b + 2 * elementwise + overhead,
        w=gemm_w + overhead,
        attention_f=attention,
        tp_bytes=tokens * h * BF16,
        ep_bytes=tokens * model.experts_per_token * h * BF16 / tp if moe else 0.0,
        gemm_f=gemm,
    )


def weight_tensors(model: ModelConfig, *, moe: bool) -> int:
    """Parameter tensors of one block (each its own weight-gradient call in a split backward):
    two norms, four attention projections, and the MLP's (router, grouped experts' three,
    shared experts' three) or the dense MLP's three (SwiGLU) or two."""
    if moe:
        return 2 + 4 + 1 + 3 + (3 if model.n_shared_experts else 0)
    return 2 + 4 + (3 if model.mlp == "swiglu" else 2)


def layer_flops(model: ModelConfig, *, seq: int, moe: bool) -> tuple[float, float]:
    """(GEMM, attention-core) forward FLOPs of one layer for one sequence, Megatron's counting."""
    h, hq, hkv = model.dim, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    params = 2 * h * hq + 2 * h * hkv
    if moe:
        fe = model.moe_ffn_dim
        params += h * model.n_experts + 3 * h * fe * (model.experts_per_token + model.n_shared_experts)
    else:
        params += (3 if model.mlp == "swiglu" else 2) * h * model.ffn_dim
    return 2.0 * seq * params, 4.0 * seq * seq * hq


@_by_identity
def step_flops(model: ModelConfig, workload: Workload, recompute: str) -> tuple[float, float]:
    """(model, hardware) FLOPs of one step: 3 passes; hardware adds the recomputed forward."""
    s = workload.seq_len
    gemm_total = attn_total = 0.0
    for i in range(model.n_layers):
        gemm, attn = layer_flops(model, seq=s, moe=model.is_moe_layer(i))
        gemm_total += gemm
        attn_total += attn
    logits = 2.0 * s * model.dim * model.vocab_size
    model_flops = 3 * workload.global_batch * (gemm_total + attn_total + logits)
    extra = {"none": 0.0, "selective": attn_total, "full": gemm_total + attn_total}[recompute]
    return model_flops, model_flops + workload.global_batch * extra


def problems(model: ModelConfig, workload: Workload, cluster: Cluster, layout: Layout, world_size: int) -> list[str]:
    """Why a layout cannot run this model, or an empty list."""
    out = []
    lay = layout
    if lay.world_size != world_size:
        out.append(f"dp={lay.dp} x tp={lay.tp} x pp={lay.pp} = {lay.world_size}, not {world_size} GPUs")
    for problem in (
            rules.tp_problem(lay.tp, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, ffn_dim=model.ffn_dim,
                             vocab_size=model.vocab_size, expert_ffn_dim=model.moe_ffn_dim,
                             n_experts=model.n_experts, padded=True),
            rules.ep_problem(lay.ep, dp=lay.dp, n_experts=model.n_experts),
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
        lay.to_plan().validate()
    except Exception as exc:  # UserError: reuse the trainer's own rules verbatim
        out.append(str(exc).removeprefix("invalid plan: "))
    return out


def evaluate(model: ModelConfig, cluster: Cluster, workload: Workload, layout: Layout,
             options: Options = Options()) -> Estimate:
    """Predicted step time, breakdown and peak memory of a (valid) layout."""
    lay = layout
    seq, m, p, v = workload.seq_len, lay.microbatches, lay.pp, lay.virtual
    world = lay.world_size
    peak = cluster.peak_flops_per_rank(world)
    memory_bw = cluster.memory_bw_per_rank(world)
    n = layers_per_stage(model.n_layers, p, v)
    n_moe_total = moe_layer_count(model)
    n_moe = min(n, n_moe_total)  # the most loaded stage holds MoE layers where there are any
    n_dense = n - n_moe
    fw, queue = cluster.framework, cluster.queueing(world)
    overhead = fw.layer_overhead_us * 1e-6 * queue
    if lay.tp > 1:
        overhead += (cluster.framework.tp_layer_overhead_us * 1e-6 + (cluster.framework.sp_layer_overhead_us * 1e-6 if lay.sp else 0.0)
                     + cluster.framework.tp_element_overhead_ns * 1e-9 * lay.mbs * seq * model.dim) * cluster.queueing(world)
    kw = dict(seq=seq, mbs=lay.mbs, tp=lay.tp, ep=lay.ep, sp=lay.sp, peak=peak, flash=options.flash_attention,
              memory_bw=memory_bw, overhead=overhead)
    dense = layer_cost(model, cluster, moe=False, **kw)
    moe = layer_cost(model, cluster, moe=True, **kw) if n_moe else dense

    # Exposed communication per layer per micro-batch, forward and backward.
    t_tp = _collective(comm.all_reduce, cluster, dense.tp_bytes, lay.tp, 1) * 2

    sm = cluster.hidden_comm_cost

    def exposed(t: float, gemm: float) -> float:
        """Time a TP collective adds to its layer; pipelined with the GEMM (--tp-overlap), the
        part it hides still takes the SMs it runs on from that GEMM."""
        if not options.tp_overlap:
            return t
        shown = max(t - gemm, 0.0) + min(t, gemm) / lay.tp
        return shown + sm * (t - shown)

    rc_share = recompute_share(model, lay)  # of the stage's layers, those checkpointed
    # Where SP stores the attention and MLP inputs sharded (Options.sp_regather, as Korthikanti
    # et al. count them), backward gathers them again for the weight gradients: 2 all-gathers
    # of T h per layer, except in the layers whose full recompute has just gathered them (only
    # those: with recompute_layers=k the other layers still regather).
    regather = options.sp_regather and lay.sp and lay.tp > 1
    t_regather = 2 * _collective(comm.reduce_scatter, cluster, dense.tp_bytes, lay.tp, 1) if regather else 0.0
    if lay.recompute == "full":
        t_regather *= 1 - rc_share
    t_ep = _collective(comm.all_to_all, cluster, moe.ep_bytes, lay.ep, lay.tp) * 2 if n_moe else 0.0
    if lay.schedule == "dualpipev" and p > 1:
        t_ep = max(0.0, t_ep - moe.f) + sm * min(t_ep, moe.f)  # hidden behind the paired micro-batch's compute
    tp_f = n_dense * exposed(t_tp, dense.gemm_f) + n_moe * exposed(t_tp, moe.gemm_f)
    tp_b = tp_f + n_dense * exposed(t_regather, dense.gemm_f) + n_moe * exposed(t_regather, moe.gemm_f)
    ep_f = n_moe * t_ep

    # Logits and loss on the last stage (vocab split over tp).
    tokens = lay.mbs * seq
    vocab = model.vocab_size / lay.tp
    logit_f, logit_b, logit_w = (gemm_time(a, b, c, cluster=cluster, peak=peak) for a, b, c in
                                 ((tokens, vocab, model.dim), (tokens, model.dim, vocab), (vocab, model.dim, tokens)))
    logit_elements = tokens * vocab

    # Tensor parallelism's cost beyond the layers (DTensor embedding, output and loss; CPUs).
    tp_root = cluster.framework.tp_microbatch_overhead_us * 1e-6 * cluster.queueing(world) if lay.tp > 1 else 0.0
    comp_f = n_dense * dense.f + n_moe * moe.f + logit_f + logit_elements * LOSS_BYTES_F / memory_bw + tp_root
    comp_b = n_dense * dense.b + n_moe * moe.b + logit_b + logit_elements * LOSS_BYTES_B / memory_bw
    comp_w = n_dense * dense.w + n_moe * moe.w + logit_w
    if lay.recompute != "none":  # checkpointing's own framework cost (measured on CPUs)
        comp_r_fixed = n * cluster.framework.recompute_overhead_us * 1e-6 * cluster.queueing(world)
    else:
        comp_r_fixed = 0.0
    comp_rw = 0.0  # forwards re-run for the weight gradients, in the W slots
    if lay.recompute == "full":
        comp_r, comm_r = n_dense * dense.f + n_moe * moe.f + comp_r_fixed, tp_f + ep_f
        if options.split_backward_recompute and p > 1 and lay.schedule == "zbv":
            rerun = cluster.framework.split_rerun_overhead_us * 1e-6 * cluster.queueing(world)
            comp_rw = (n_dense * weight_tensors(model, moe=False) * (dense.f + rerun)
                       + n_moe * weight_tensors(model, moe=True) * (moe.f + rerun)
                       + n_dense * weight_tensors(model, moe=False) * exposed(t_tp, dense.gemm_f)
                       + n_moe * weight_tensors(model, moe=True) * (exposed(t_tp, moe.gemm_f) + t_ep))
    elif lay.recompute == "selective":
        comp_r, comm_r = n_dense * dense.attention_f + n_moe * moe.attention_f + comp_r_fixed, 0.0
    else:
        comp_r = comm_r = 0.0
    comp_r, comm_r, comp_rw = comp_r * rc_share, comm_r * rc_share, comp_rw * rc_share
    stage = StageTimes(f=comp_f + tp_f + ep_f, b=comp_b + tp_b + ep_f, w=comp_w + comp_rw, r=comp_r + comm_r,
                       f_comm=tp_f + ep_f, b_comm=tp_b + ep_f, r_comm=comm_r)
    per_mb = stage.f + stage.b + stage.w + stage.r

    bubble = _bubble(lay.schedule, p, v, stage, m)
    # Pipeline sends on the critical path: each micro-batch (per chunk) each way, plus fill/drain.
    if p > 1:
        boundary_bytes = tokens * model.dim * BF16 / (lay.tp if lay.sp else 1)
        same = lay.tp * lay.dp * 2 <= cluster.fast_domain
        t_send = comm.send(cluster, boundary_bytes, same_domain=same)
        pp_comm = 2 * t_send * (m * v + p - 1)
        # The pipeline runtime's own cost per action beyond compute and bytes (CPUs, measured).
        pp_comm += m * actions_per_microbatch(lay.schedule, v) * cluster.framework.pp_action_s(lay.schedule) * cluster.queueing(world)
    else:
        pp_comm = 0.0

    c, shared_params, expert_params = stage_params(model, lay, n, n_moe)
    regathered = rc_share if lay.recompute == "full" and options.recompute_regathers else 0.0
    dp_comm = dp_time(cluster, lay, options, shared_params, expert_params, stage, n, regathered)
    shards = lay.dp // lay.replicate
    local_state = shared_params / (shards if lay.zero else 1) + expert_params / (max(1, shards // lay.ep) if lay.zero else 1)
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
        "compute": m * (comp_f + comp_b + comp_w),
        "recompute": m * (comp_r + comp_rw),
        "tp_comm": m * (tp_f + tp_b + (tp_f * rc_share if lay.recompute == "full" else 0.0)),
        "ep_comm": m * (2 * ep_f + (ep_f * rc_share if lay.recompute == "full" else 0)),
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
        model_flops=model_flops, hardware_flops=hardware_flops, world_size=world, peak_flops=peak,
        tokens=workload.global_batch * seq, seq_len=seq, hidden_size=model.dim, stage=stage,
    )


def step_time_lower_bound(model: ModelConfig, cluster: Cluster, workload: Workload, layout: Layout,
                          options: Options = Options()) -> float:
    """Seconds no step of this layout can beat: the most loaded stage's layer compute (forward,
    input and weight gradients, and the recomputed forward) over its micro-batches, plus the
    bubble of the schedules whose bubble grows with that compute (gpipe, 1f1b, interleaved:
    (p-1)/v stage times), each a part of what `evaluate` sums, every other part being at
    least 0. Lets a search skip pricing layouts that cannot win."""
    lay, seq = layout, workload.seq_len
    world = lay.world_size
    n = layers_per_stage(model.n_layers, lay.pp, lay.virtual)
    n_moe = min(n, moe_layer_count(model))
    kw = dict(seq=seq, mbs=lay.mbs, tp=lay.tp, ep=lay.ep, sp=lay.sp, peak=cluster.peak_flops_per_rank(world),
              flash=options.flash_attention, memory_bw=cluster.memory_bw_per_rank(world), overhead=0.0)
    dense = layer_cost(model, cluster, moe=False, **kw)
    moe = layer_cost(model, cluster, moe=True, **kw) if n_moe else dense
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
