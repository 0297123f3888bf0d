"""One micro-batch through the most loaded pipeline stage: its layers' compute and the tensor-
and expert-parallel communication inside them (cost.py adds the bubble, the pipeline sends, the
data-parallel traffic and the optimizer step).

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
    pass) and activation checkpointing (`recompute_overhead_us`, per layer per micro-batch).
Communication per layer per micro-batch (comm.py for the alpha-beta times):
  TP: 2 all-reduces of T h bf16 forward, 2 backward (with sp: all-gathers + reduce-scatters
    of the same bandwidth cost, plus, with `Options.sp_regather`, 2 all-gathers in backward to
    re-gather the inputs SP stores sharded); exposed, or pipelined with the GEMMs with `tp_overlap`.
  EP: dispatch + combine all-to-all of T k h / tp bf16 forward, the same backward; DualPipe
    (dualpipev) overlaps them with the other micro-batch's compute, as it was designed to.
  CP: T = mbs * seq / cp tokens per rank attend to all seq keys (the causal work is even over
    the group by the chunking); one all-gather of the whole sequence's keys and values
    (2 seq h_kv / tp bf16) over the cp group forward, a reduce-scatter of their gradients
    backward, exposed; the group is tp-strided, inside the NVLink domain while tp x cp fits
    in it. The phalanx trainer runs the flash kernels on key blocks (the causal half skipped,
    as everywhere) and hides the gather and the reduce-scatter behind each chunk's diagonal
    block only, 1/(2 cp) of a rank's attention (`trainer_cp_hidden`); with the plan's
    cp_ring=true (or `Options.cp_overlap` for other implementations) the same bytes go around
    a ring in cp - 1 steps, each hidden behind one of cp equal steps of attention (`cp_exposed`).
Full recompute under zbv re-runs each block's forward once more per weight tensor, in the
  W slots (Options.split_backward_recompute: PyTorch's split backward).
The last stage's logits and loss are charged to the most loaded stage as well.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from phalanx.model.config import ModelConfig
from phalanx.planner import comm, dispatch, latent_attention
from phalanx.planner.hardware import Cluster
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.memo import by_identity as _by_identity
from phalanx.planner.memo import collective_time as _collective
from phalanx.planner.memory import layer_activation_bytes, layers_per_stage
from phalanx.planner.options import Options, activation_bytes
from phalanx.planner.peak_memory import BF16, folds_experts, kv_gather_bytes, moe_layer_count, recompute_share

LOSS_BYTES_F = 22
"""HBM bytes per logit element of cross-entropy on fp32 logits (the trainer's
F.cross_entropy(logits.float())), forward: the cast reads bf16 and writes fp32 (2 + 4);
log-softmax over a row too long for shared memory reads it for the maximum, again for the
sum of exponentials, and a third time to write the result (3 x 4 + 4)."""
LOSS_BYTES_B = 26
"""Backward: the loss gradient is written dense (4); log-softmax backward reads it for its
sum, then reads it and the saved output and writes the input gradient (4 + 12); the cast
back to bf16 reads fp32 and writes bf16 (4 + 2)."""


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
    cp_bytes: float = 0.0
    """The whole sequence's keys and values that the cp group all-gathers (0 without cp)."""
    attention_b: float = 0.0
    """The attention core's backward (its share of `b`)."""


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
               moe: bool, peak: float, flash: bool, memory_bw: float, overhead: float,
               tp_splits_experts: bool = True, fold_experts: bool = False, cp: int = 1,
               act_bytes: int = BF16) -> LayerCost:
    """Forward, input-gradient and weight-gradient seconds of one layer for one micro-batch.

    `tp_splits_experts`: False where the MoE block stays out of tensor parallelism (the phalanx
    trainer today): every tp rank then runs its ep share of whole experts, router and shared
    experts on all the micro-batch's tokens, and dispatches all of them, tp times the work and
    the bytes of a split MoE block per device. `fold_experts`: the trainer's ep_over_tp=true
    (MoE parallel folding): `ep` spans dp x tp, each device holds n_experts / ep whole experts
    and dispatches 1/tp of the routed rows; router and shared experts still run on every tp
    rank (the all-gather of the rows over tp is charged with the all-to-all, `stage_cost`).
    `cp`: this rank's seq / cp positions of each sequence against every key. `act_bytes`: 2,
    or 4 where the run computes in fp32 (`Options.fp32_compute`): activations, scores and
    collectives twice the bytes."""
    tokens = mbs * seq // cp
    h = model.dim
    one = functools.partial(gemm_time, cluster=cluster, peak=peak)

    def g(m: float, n: float, k: float) -> tuple[float, float, float]:
        # Forward (m x k)(k x n); input gradient (m x n)(n x k); weight gradient (n x m)(m x k):
        # the same FLOPs, different output shapes, hence different wave fill.
        return one(m, n, k), one(m, k, n), one(n, k, m)

    parts = [g(tokens, n, k) for n, k in latent_attention.gemm_shapes(model, tp)]  # q, k, v (or latents), o
    expert_tp = tp if tp_splits_experts else 1  # how many ways each expert's matrices are split
    fold = tp if fold_experts and not tp_splits_experts else 1  # tp ranks sharing the routed rows
    if moe:
        k, fe = model.experts_per_token, model.moe_ffn_dim
        parts.append(g(tokens, model.n_experts, h))
        per_expert = tokens * k * ep / model.n_experts / fold  # tokens each local expert sees
        local = model.n_experts / ep  # experts on this device, one GEMM each
        for p in [g(per_expert, fe / expert_tp, h)] * 2 + [g(per_expert, h, fe / expert_tp)]:
            parts.append(tuple(local * t for t in p))
        if model.n_shared_experts:
            fs = fe * model.n_shared_experts
            parts += [g(tokens, fs / expert_tp, h)] * 2 + [g(tokens, h, fs / expert_tp)]
    elif model.mlp == "swiglu":
        parts += [g(tokens, model.ffn_dim / tp, h)] * 2 + [g(tokens, h, model.ffn_dim / tp)]
    else:
        parts += [g(tokens, model.ffn_dim / tp, h), g(tokens, h, model.ffn_dim / tp)]
    gemm, gemm_b, gemm_w = (sum(p[i] for p in parts) for i in range(3))
    stored = layer_activation_bytes(model, seq=seq, mbs=mbs, tp=tp, sp=sp, recompute="none", moe=moe, flash=True,
                                    tp_splits_experts=tp_splits_experts, fold_experts=fold_experts, cp=cp)
    elementwise = 2 * stored * (act_bytes / BF16) / (memory_bw * cluster.elementwise_efficiency)
    if flash:  # fused kernel: masked blocks skipped, scores never leave the chip
        attention = 0.5 * 4 * tokens * seq * latent_attention.core_width(model) / tp / (peak * cluster.attention_efficiency)
        attention_b = 2.5 * attention
    else:
        # Two batched GEMMs over the whole s x s score matrix (the mask is applied after them),
        # backward twice the forward's FLOPs; between them the scores go through HBM, `a` bytes
        # each: fused scale-mask-softmax reads and writes them (2a per score forward, 3a
        # backward: gradient and probabilities in, gradient out); GPT-style dropout on the
        # probabilities 2a + 1 more each way (in, out, a 1-byte mask). In fp32 Megatron's fused
        # kernel does not run (FusedScaleMaskSoftmax.is_kernel_available needs 16-bit input):
        # torch scales, fills the mask and takes the softmax as three passes, each reading and
        # writing the scores (6a + 1 forward, the mask read once), and autograd undoes them as
        # three (softmax 3a, mask fill 2a + 1, scale 2a).
        attention = 4 * tokens * seq * latent_attention.core_width(model) / tp / (peak * cluster.attention_efficiency)
        attention_b = 2 * attention
        scores = tokens * model.n_heads * seq / tp
        a = act_bytes
        dropout = 2 * a + 1 if model.mlp == "gelu" else 0
        softmax_f, softmax_b = (2 * a, 3 * a) if a == BF16 else (6 * a + 1, 7 * a + 1)
        attention += scores * (softmax_f + dropout) / memory_bw
        attention_b += scores * (softmax_b + dropout) / memory_bw
    return LayerCost(
        f=gemm + attention + elementwise + overhead,
        b=gemm_b + attention_b + 2 * elementwise + overhead,
        w=gemm_w + overhead,
        attention_f=attention,
        attention_b=attention_b,
        tp_bytes=tokens * h * act_bytes,
        ep_bytes=tokens * model.experts_per_token * h * act_bytes / (expert_tp * fold) if moe else 0.0,
        gemm_f=gemm,
        cp_bytes=kv_gather_bytes(model, mbs, seq, tp) if cp > 1 else 0.0,
    )


def trainer_cp_hidden(cp: int) -> float:
    """The share of a cp rank's attention work (forward or backward) that the phalanx trainer
    runs while its key/value gather (or their gradients' reduce-scatter) travels: the causal
    diagonal blocks of its two chunks, which need only its own keys
    (parallel/context_parallel_schedule.py). Chunk c of length k holds k^2 c + k(k+1)/2 causal
    pairs, a rank's two chunks k^2 (2cp - 1) + k(k+1), of which the diagonals k(k+1): about
    1/(2 cp) of them (layout_rules.causal_pairs; by the layout, not a fit)."""
    return 1 / (2 * cp)


def cp_exposed(t_cp: float, attention: float, sm: float, model: ModelConfig, lay: Layout, options: Options) -> float:
    """Seconds one layer's cp transfer adds to one pass (forward: the key/value all-gather,
    backward: their gradients' reduce-scatter, each `t_cp`), given the pass's `attention`
    compute; a hidden transfer still takes `sm` of its time from the compute it hides behind
    (`Cluster.hidden_comm_cost`).
    - The ring (the plan's cp_ring=true, or `Options.cp_overlap` for other implementations):
      cp - 1 point-to-point steps, each one rank's keys (1/cp of the gather's bytes over the
      same links, so t_cp / (cp - 1) each, as a ring all-gather's steps are), each in flight
      while one of the cp equal steps of attention computes (`layout_rules.ring_step_pairs`).
    - The phalanx trainer's gather: hidden behind the chunks' diagonal blocks
      (`trainer_cp_hidden`); latent attention gathers before its attention, exposed.
    - Other implementations' gather (Llama 3's): exposed."""
    if lay.cp == 1:
        return 0.0
    if lay.cp_ring or options.cp_overlap:
        steps = lay.cp - 1
        step, hide = t_cp / steps, attention / lay.cp
        return steps * (max(step - hide, 0.0) + sm * min(step, hide))
    hide = trainer_cp_hidden(lay.cp) * attention if options.phalanx_trainer and not model.is_latent else 0.0
    return max(t_cp - hide, 0.0) + sm * min(t_cp, hide)


def weight_tensors(model: ModelConfig, *, moe: bool) -> int:
    """Parameter tensors of one block (each its own weight-gradient call in a split backward):
    two norms, four attention projections, and the MLP's (router, grouped experts' three,
    shared experts' three) or the dense MLP's three (SwiGLU) or two."""
    if moe:
        return 2 + 4 + 1 + 3 + (3 if model.n_shared_experts else 0)
    return 2 + 4 + (3 if model.mlp == "swiglu" else 2)


def layer_costs(model: ModelConfig, cluster: Cluster, workload: Workload, lay: Layout, options: Options, *,
                overhead: float, moe: bool) -> tuple[LayerCost, LayerCost]:
    """(dense, MoE) layer costs of this layout; the dense one twice when the stage holds no MoE layer."""
    world = lay.world_size
    kw = dict(seq=workload.seq_len, mbs=lay.mbs, tp=lay.tp, ep=lay.ep, sp=lay.sp,
              peak=cluster.compute_flops_per_rank(world, fp32=options.fp32_compute), flash=options.flash_attention,
              memory_bw=cluster.memory_bw_per_rank(world), overhead=overhead,
              tp_splits_experts=options.tp_splits_experts, fold_experts=folds_experts(lay), cp=lay.cp,
              act_bytes=activation_bytes(options))
    dense = layer_cost(model, cluster, moe=False, **kw)
    return dense, layer_cost(model, cluster, moe=True, **kw) if moe else dense


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """The most loaded stage for one micro-batch: its times, and the parts of them the step's
    breakdown reports."""

    times: StageTimes
    compute: float
    """Forward, input- and weight-gradient compute (layers, logits and loss)."""
    recompute: float
    """Re-run forwards: before backward, and under zbv's split backward in the W slots."""
    tp_comm: float
    """Exposed tensor-parallel collectives: forward, backward and the recompute's."""
    ep_comm: float
    """Exposed expert all-to-alls: forward, backward and the recompute's."""
    cp_comm: float
    """Exposed context-parallel key/value gathers and gradient reduce-scatters, the recompute's too."""
    layers: int
    moe_layers: int
    recomputed_share: float
    """Of the stage's layers, those checkpointed."""


def stage_cost(model: ModelConfig, cluster: Cluster, workload: Workload, lay: Layout, options: Options) -> StageCost:
    """Forward, backward, weight-gradient and recompute seconds of one micro-batch on the most
    loaded stage, TP and EP communication included."""
    seq, p, v = workload.seq_len, lay.pp, lay.virtual
    world = lay.world_size
    peak = cluster.compute_flops_per_rank(world, fp32=options.fp32_compute)
    memory_bw = cluster.memory_bw_per_rank(world)
    n = layers_per_stage(model.n_layers, p, v)
    n_moe_total = moe_layer_count(model)
    n_moe = min(n, n_moe_total)  # the most loaded stage holds MoE layers where there are any
    n_dense = n - n_moe
    fw, queue = cluster.framework, cluster.queueing(world)
    overhead = fw.layer_overhead_us * 1e-6 * queue
    if lay.tp > 1:
        overhead += (cluster.framework.tp_layer_overhead_us * 1e-6 + (cluster.framework.sp_layer_overhead_us * 1e-6 if lay.sp else 0.0)
                     + cluster.framework.tp_element_overhead_ns * 1e-9 * (lay.mbs * seq // lay.cp) * model.dim) * cluster.queueing(world)
    dense, moe = layer_costs(model, cluster, workload, lay, options, overhead=overhead, moe=n_moe > 0)

    # Exposed communication per layer per micro-batch, forward and backward: two all-reduces
    # (attention, MLP), one in an MoE layer whose MoE block stays out of tp.
    t_tp = _collective(comm.all_reduce, cluster, dense.tp_bytes, lay.tp, 1) * 2
    t_tp_moe = t_tp if options.tp_splits_experts else t_tp / 2

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
    # Group-limited routing sends each token to at most topk_groups nodes (planner/dispatch.py).
    ep_bytes = moe.ep_bytes * dispatch.copies_share(model, ep=lay.ep, local=comm.per_domain(cluster, size=lay.ep, stride=lay.tp))
    t_ep = _collective(comm.all_to_all, cluster, ep_bytes, lay.ep, lay.tp) * 2 if n_moe else 0.0
    if n_moe and folds_experts(lay):
        # Folded: the ep group is lay.ep adjacent ranks of dp x tp, and the rows (all the
        # micro-batch's k assignments) are all-gathered back over tp; t_ep counts one direction
        # (backward charges it again): there the slice's backward is the all-gather.
        t_ep = (_collective(comm.all_to_all, cluster, moe.ep_bytes, lay.ep, 1) * 2
                + _collective(comm.all_gather, cluster, moe.ep_bytes * lay.tp, lay.tp, 1))
    if lay.schedule == "dualpipev" and p > 1:
        t_ep = max(0.0, t_ep - moe.f) + sm * min(t_ep, moe.f)  # hidden behind the paired micro-batch's compute
    tp_f = n_dense * exposed(t_tp, dense.gemm_f) + n_moe * exposed(t_tp_moe, moe.gemm_f)
    tp_b = tp_f + n_dense * exposed(t_regather, dense.gemm_f) + n_moe * exposed(t_regather, moe.gemm_f)
    ep_f = n_moe * t_ep
    # Context parallelism: per layer one gather forward, one reduce-scatter (the same cost)
    # backward; folded into the tp terms below, which carry the same exposure rules.
    t_cp = _collective(comm.all_gather, cluster, dense.cp_bytes, lay.cp, lay.tp) if lay.cp > 1 else 0.0
    # Each transfer against the attention compute that runs while it travels (`cp_exposed`).
    cp_f = n * cp_exposed(t_cp, dense.attention_f, sm, model, lay, options)
    cp_b = n * cp_exposed(t_cp, dense.attention_b, sm, model, lay, options)
    tp_f, tp_b = tp_f + cp_f, tp_b + cp_b

    # Logits and loss on the last stage (vocab split over tp).
    tokens = lay.mbs * seq // lay.cp
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
                       + n_moe * weight_tensors(model, moe=True) * (exposed(t_tp_moe, moe.gemm_f) + t_ep))
    elif lay.recompute == "selective":
        # The trainer's cp gather is inside the attention core's op, which selective recompute re-runs.
        regather = cp_f if options.phalanx_trainer and not model.is_latent else 0.0
        comp_r, comm_r = n_dense * dense.attention_f + n_moe * moe.attention_f + comp_r_fixed, regather
    else:
        comp_r = comm_r = 0.0
    comp_r, comm_r, comp_rw = comp_r * rc_share, comm_r * rc_share, comp_rw * rc_share
    stage = StageTimes(f=comp_f + tp_f + ep_f, b=comp_b + tp_b + ep_f, w=comp_w + comp_rw, r=comp_r + comm_r,
                       f_comm=tp_f + ep_f, b_comm=tp_b + ep_f, r_comm=comm_r)
    recomputed_tp = tp_f * rc_share if lay.recompute == "full" else 0.0
    recomputed_ep = ep_f * rc_share if lay.recompute == "full" else 0.0
    recomputed_cp = cp_f * rc_share if lay.recompute == "full" else 0.0  # inside recomputed_tp
    regathered = comm_r if lay.recompute == "selective" else 0.0  # the trainer's gather re-run with its core
    return StageCost(times=stage, compute=comp_f + comp_b + comp_w, recompute=comp_r + comp_rw,
                     tp_comm=tp_f + tp_b + recomputed_tp - (cp_f + cp_b + recomputed_cp), ep_comm=2 * ep_f + recomputed_ep,
                     cp_comm=cp_f + cp_b + recomputed_cp + regathered, layers=n, moe_layers=n_moe, recomputed_share=rc_share)
