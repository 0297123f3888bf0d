"""Peak bytes per device of one layout, by cause: the memory half of the cost model.

`evaluate` (cost.py) reports these beside the step time; a search calls `memory_breakdown`
first and prices only the layouts that fit. The formulas per tensor are in memory.py; this
assembles them for the most loaded rank of a layout (its stage, schedule and ZeRO level).
"""

from __future__ import annotations

import math

from phalanx import layout_rules as rules
from phalanx.model.config import ModelConfig
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.options import Options
from phalanx.planner.memory import (
    GATHERED_LAYERS,
    ParamCounts,
    in_flight_microbatches,
    layer_activation_bytes,
    layers_per_stage,
    offloaded_bytes,
    param_counts,
    state_bytes,
)

BF16 = 2
BUCKET_BYTES = 25 * 2**20
"""Gradient bucket of DDP (bucket_cap_mb=25) and similar: one collective each."""

_COUNTS: dict[int, tuple[ModelConfig, ParamCounts, int]] = {}
_ACTIVATIONS: dict[tuple, tuple] = {}
"""Caches keyed on the model's identity (hashing a frozen ModelConfig costs more than the
formulas): a search passes the very same objects thousands of times."""


def _counts(model: ModelConfig) -> tuple[ParamCounts, int]:
    hit = _COUNTS.get(id(model))
    if hit is None or hit[0] is not model:
        hit = _COUNTS[id(model)] = (model, param_counts(model), model.n_moe_layers)
    return hit[1], hit[2]


def param_counts_of(model: ModelConfig) -> ParamCounts:
    return _counts(model)[0]


def moe_layer_count(model: ModelConfig) -> int:
    return _counts(model)[1]


def recompute_share(model: ModelConfig, lay: Layout) -> float:
    """Share of a rank's layers that recompute: all, or `recompute_layers` of each chunk's."""
    if lay.recompute == "none":
        return 0.0
    chunk = math.ceil(model.n_layers / (lay.pp * lay.virtual))
    return min(lay.recompute_layers, chunk) / chunk if lay.recompute_layers else 1.0


def stage_heads(model: ModelConfig, lay: Layout) -> int:
    """V x h matrices on the most loaded device: embedding and output head, or one of them
    (tied, or a pipeline's first or last stage)."""
    return 2 if (lay.pp == 1 and not model.tie_embeddings) else 1


def expert_tp(lay: Layout, options: Options | None) -> int:
    """Ways tp splits the MoE block's matrices (router, shared and routed experts): tp where the
    implementation splits them (Megatron, `Options.tp_splits_experts`), else 1: the phalanx
    trainer keeps the MoE block out of tp, every tp rank holding its ep share of whole experts
    (parallel/tensor_parallel.apply_tp); folded (`folds_experts`), that share is already
    n_experts / ep with ep over dp x tp."""
    return lay.tp if options is None or options.tp_splits_experts else 1


def folds_experts(lay: Layout) -> bool:
    """The trainer's `ep_over_tp=true` (MoE parallel folding, parallel/expert_fold.py): the
    layout's ep is drawn from dp x tp ranks, each holding n_experts / ep whole experts, and each
    tp rank dispatches and computes 1/tp of the routed rows (router and shared experts whole)."""
    return lay.ep_over_tp and lay.tp > 1 and lay.ep > 1


def expert_shards(lay: Layout, shard: int) -> int:
    """Ranks one expert's weights are sharded (or replicated) over, "edp": the dp shard group
    divided by ep; folded, the shard group times tp divided by ep (ep spans tp)."""
    return max(1, shard * (lay.tp if folds_experts(lay) else 1) // lay.ep)


def slots_per_expert(model: ModelConfig, options: Options | None) -> float:
    """Expert slots per expert, S / n_experts (`Options.expert_slots`; 1 without slots): a rank
    holds S / ep slots of weights, gradients and optimizer state where it held n_experts / ep
    experts. The routed rows, and so the expert compute, activations and all-to-all bytes, do
    not change with S: replicas split an expert's rows, they do not add any."""
    slots = options.expert_slots if options is not None else 0
    return slots / model.n_experts if slots and model.n_experts else 1.0


def stage_params(model: ModelConfig, lay: Layout, n: int, n_moe: int, options: Options | None = None):
    """Parameters on the most loaded device (first or last stage: embedding or output head):
    (counts, shared over tp, experts over ep and, where it splits them, tp; with expert slots,
    S / ep slots' worth)."""
    c = param_counts_of(model)
    split = expert_tp(lay, options)
    shared = ((n * (c.attention + c.norms) + (n - n_moe) * c.dense_mlp + stage_heads(model, lay) * c.embedding) / lay.tp
              + n_moe * c.moe_other / split)
    return c, shared, n_moe * c.experts * slots_per_expert(model, options) / (split * lay.ep)


def gathered_kv_bytes(model: ModelConfig, mbs: int, seq: int, tp: int) -> float:
    """Bytes of one layer's keys and values of the whole sequence on one rank (its tp share of
    the KV heads), in 16-bit: what attention reads under context parallelism (for latent
    attention, decompressed on the rank from the gathered latent)."""
    return mbs * seq * model.n_kv_heads * (model.head_dim + model.value_dim) / tp * BF16


def kv_gather_bytes(model: ModelConfig, mbs: int, seq: int, tp: int) -> float:
    """Bytes one rank holds of what context parallelism all-gathers per layer over the cp ranks
    forward (and reduce-scatters the gradients of backward): the keys and values of its KV
    heads, or with latent attention the latent and the rotated shared key (kv_lora_rank +
    qk_rope_head_dim per token, whole on every tp rank: parallel/context_parallel.py gathers
    those and decompresses per rank; DeepSeek-V3: 576 values against 128 x (192 + 128))."""
    if model.is_latent:
        return mbs * seq * (model.kv_lora_rank + model.qk_rope_head_dim) * BF16
    return gathered_kv_bytes(model, mbs, seq, tp)


def memory_breakdown(model: ModelConfig, workload: Workload, layout: Layout,
                     options: Options) -> dict[str, float]:
    """The peak bytes by cause that `evaluate` reports, without the time model: a search
    prunes the layouts that do not fit with this before it prices any of them."""
    n = layers_per_stage(model.n_layers, layout.pp, layout.virtual)
    n_moe = min(n, moe_layer_count(model))
    c, shared, experts = stage_params(model, layout, n, n_moe, options)
    return peak_memory(model, workload, layout, options, n, n_moe, shared, experts, c)[0]


def fsdp_replicates(lay: Layout, options: Options) -> bool:
    """Whether the phalanx trainer runs this layout's replicated data parallelism (zero 0) as FSDP2
    with shard size 1: beside tp or pp, which torch DDP does not take."""
    return options.phalanx_trainer and lay.zero == 0 and lay.replicas > 1 and (lay.tp > 1 or lay.pp > 1)


def compute_copies(lay: Layout, options: Options) -> bool:
    """Whether the phalanx trainer holds 16-bit compute copies of its fp32 weights beside them: a
    16-bit run where FSDP2 does not gather the weights in param_dtype (one process, DDP, tp or pp
    without dp; parallel/data_parallel.uses_fsdp), so the trainer's own forward hooks cast them
    (parallel/mixed_precision.py)."""
    fsdp = rules.runs_fsdp(lay.replicas, zero=lay.zero, tp=lay.tp, pp=lay.pp)
    return options.phalanx_trainer and options.precision.gathered < options.precision.param and not fsdp


def fsdp_unit_params(model: ModelConfig, lay: Layout, options: Options, c, *, zero: int, moe: bool, split: int) -> float:
    """Parameters (per tp rank) of the largest FSDP unit of a layer, not counting routed experts:
    what FSDP gathers, prefetches and reduces at once (`layer_params` of state_bytes, and the
    unit staging and prefetch buffers).

    A whole block, except in the phalanx trainer at zero=3 without pp, whose units go below the
    block (parallel/data_parallel.sub_block_units): the attention, each linear of a dense MLP,
    and the rest of the block (norms; an MoE's router and shared experts) as the block's own unit.
    """
    block = (c.attention + c.norms) / lay.tp + (c.moe_other / split if moe else c.dense_mlp / lay.tp)
    if not options.phalanx_trainer or zero != 3 or lay.pp > 1:
        return block
    if moe:
        return max(c.attention / lay.tp, c.norms / lay.tp + c.moe_other / split)
    linears = 3 if model.mlp == "swiglu" else 2
    return max(c.attention, c.dense_mlp / linears, c.norms) / lay.tp


def peak_memory(model: ModelConfig, workload: Workload, lay: Layout, options: Options, n: int, n_moe: int,
                shared: float, experts: float, c) -> tuple[dict[str, float], dict[str, float]]:
    """Peak bytes on the most loaded device, by cause; and what offload keeps on the host."""
    shard = lay.replicas // lay.replicate  # zero levels shard over dp x cp
    precision = options.precision
    zero = lay.zero
    if fsdp_replicates(lay, options):
        # The trainer runs replicated dp beside tp or pp as FSDP2 HSDP with shard size 1
        # (parallel/data_parallel.uses_fsdp), not resharded after forward: zero 2 with one shard,
        # the whole local weights and their gathered copy (measured: tiny, dp=2,pp=2 holds its
        # stage's parameters twice, benchmarks/README.md).
        zero, shard = 2, 1
    split = expert_tp(lay, options)
    layer_shared = fsdp_unit_params(model, lay, options, c, zero=zero, moe=bool(n_moe), split=split)
    root = (stage_heads(model, lay) * c.embedding + model.dim) / lay.tp  # embedding, output, final norm
    state = state_bytes(zero=zero, shards=shard, params=shared, layer_params=layer_shared,
                        microbatches=lay.microbatches, pp=lay.pp, precision=precision, offload=lay.offload,
                        root_params=root, reduce_each_microbatch=options.reduce_each_microbatch)
    host = offloaded_bytes(shards=shard, params=shared, precision=precision) if lay.offload else {}
    if experts:
        expert_state = state_bytes(zero=zero, shards=expert_shards(lay, shard), params=experts,
                                   layer_params=c.experts * slots_per_expert(model, options) / (split * lay.ep),
                                   microbatches=lay.microbatches, pp=lay.pp,
                                   precision=precision, offload=lay.offload,
                                   reduce_each_microbatch=options.reduce_each_microbatch)
        state = {k: v + expert_state[k] for k, v in state.items()}
        if lay.offload:
            extra = offloaded_bytes(shards=expert_shards(lay, shard), params=experts, precision=precision)
            host = {k: v + extra[k] for k, v in host.items()}
    kw = dict(seq=workload.seq_len, mbs=lay.mbs, tp=lay.tp, sp=lay.sp, cp=lay.cp)
    scale = precision.activation / 2  # the formulas count 16-bit elements

    copies = compute_copies(lay, options)
    wide = precision.activation < 4 and not options.fused_norm  # fp32 norm tensors

    def per_layer(moe: bool, recompute: str) -> float:
        key = (id(model), id(options), workload.seq_len, lay.mbs, lay.tp, lay.sp, lay.cp, moe, recompute, wide,
               folds_experts(lay))
        hit = _ACTIVATIONS.get(key)
        if hit is None or hit[0] is not model or hit[1] is not options:
            value = layer_activation_bytes(model, flash=options.flash_attention, sp_regather=options.sp_regather,
                                           fused_norm=options.fused_norm, phalanx_model=options.phalanx_trainer,
                                           wide_norms=wide, moe=moe, recompute=recompute,
                                           tp_splits_experts=options.tp_splits_experts,
                                           fold_experts=folds_experts(lay), **kw)
            hit = _ACTIVATIONS[key] = (model, options, value)
        return scale * hit[2]

    local_seq = workload.seq_len // lay.cp
    share = recompute_share(model, lay)  # the other layers keep all their activations
    stage_act = sum(count * (share * per_layer(moe, lay.recompute) + (1 - share) * per_layer(moe, "none"))
                    for count, moe in ((n - n_moe, False), (n_moe, True)))
    in_flight = in_flight_microbatches(schedule=lay.schedule, pp=lay.pp, virtual=lay.virtual,
                                       microbatches=lay.microbatches)
    rematerialised = per_layer(n_moe > 0, "none") if lay.recompute != "none" else 0.0
    logits = lay.mbs * local_seq * model.vocab_size / lay.tp * precision.logit
    sbh = lay.mbs * local_seq * model.dim
    norms = 1 if options.fused_norm else 2  # tensors each norm keeps of its input's size
    if wide:  # the final norm's tensors in fp32
        logits += norms * sbh / (lay.tp if lay.sp else 1) * (4 - precision.activation)
    # The last stage's head also keeps the final norm's input (and, unfused, its x / rms) and the
    # output projection's input, s b h each (Korthikanti et al. leave them out as small; the
    # probe, benchmarks/activation_probe.py, finds them). Under sp the norm runs on a sequence
    # shard; the projection's input is gathered, and kept whole unless sp_regather.
    norm_in = norms * sbh / (lay.tp if lay.sp else 1)
    proj_in = sbh / (lay.tp if lay.sp and options.sp_regather else 1)
    logits += (norm_in + proj_in) * precision.activation
    # The first rank holds the most micro-batches; the loss's logits live on the last stage,
    # which V-shaped schedules (and pp=1) put on that same first rank.
    first = stage_act * in_flight + rematerialised
    if lay.pp == 1 or lay.schedule in ("zbv", "dualpipev"):
        activations, logits_held = first, logits
    else:
        last_in_flight = lay.microbatches if lay.schedule == "gpipe" else 1
        last = stage_act * last_in_flight + rematerialised
        activations, logits_held = (first, 0.0) if first >= last + logits else (last, logits)
    if copies:
        # The trainer's bf16 copy of every weight of the stage (embedding and output included),
        # made by the step's first forward and kept until the optimizer steps: micro-batches,
        # pipeline micro-batches in flight and recomputation share it (parallel/mixed_precision.py).
        # Made in forward, so the memory trackers count it with the activations, and so does this.
        activations += precision.gathered * (shared + experts)
    # Deferred weight gradients (zbv, dualpipev) hold their linear layers' inputs until W runs,
    # but never at the activation peak: in both schedules' orders each steady-state W follows
    # its input gradient at once, and the deferred ones wait in the cool-down, after the last
    # forward, while activations only fall (tests/test_planner_memory.py counts it on the orders).
    tokens_bytes = lay.mbs * local_seq * model.dim * BF16
    buffers = 0.0
    if lay.replicas > 1 and options.phalanx_trainer and lay.zero == 0 and lay.tp == 1 and lay.pp == 1:
        # torch DDP (the trainer's zero=0 without tp or pp; experts under ep are left out of it):
        # its reducer allocates every bucket's flat gradient tensor when it is built and keeps
        # them, a second copy of the gradients (DDP's documentation of gradient_as_bucket_view,
        # which the trainer leaves False); each bucket only as large as its parameters.
        buffers += precision.grad * shared
    elif lay.replicas > 1:  # gradient buckets in flight (one reducing, one filling), or one unit's staging
        buffers += 2 * BUCKET_BYTES if zero <= 1 else 4 * layer_shared
        if zero == 3 and lay.pp == 1:  # the next layer's all-gather output, prefetched (GATHERED_LAYERS)
            buffers += precision.gathered * (GATHERED_LAYERS - 1) * layer_shared
    if lay.tp > 1:  # a gathered activation (sp) or an all-reduce's output beside its input
        buffers += 2 * tokens_bytes
    if lay.pp > 1:  # send and receive buffers, both directions
        buffers += 4 * tokens_bytes / (lay.tp if lay.sp else 1)
    if lay.cp > 1:  # the layer running's gathered keys and values, and their gradients' reduce-scatter input
        # The trainer's attention (parallel/context_parallel_attention.py) sums the gradients of
        # the whole sequence's keys and values in fp32 (2 x their bf16 bytes), then casts and
        # reorders them for the reduce-scatter: 4 in all at its backward's peak.
        # Its ring (cp_ring=true, parallel/context_parallel_ring.py) fills the kept keys and values
        # in place as they come round and sums one rank's key gradients at a time: the whole
        # sequence once, and at its backward's peak one rank's fp32 partial sums (2/cp) with the
        # pass out and the pass in (1/cp each).
        trainer = options.phalanx_trainer and not model.is_latent
        copies = (1 + 4 / lay.cp if lay.cp_ring else 4) if trainer else 2
        buffers += copies * gathered_kv_bytes(model, lay.mbs, workload.seq_len, lay.tp)
    out = {**state, "activations": activations, "logits": logits_held, "comm_buffers": buffers}
    return out, host
