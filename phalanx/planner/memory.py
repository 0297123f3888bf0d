"""Bytes per device: parameters, gradients, optimizer state, activations.

Model state follows mixed-precision Adam: bf16 parameters (2 bytes), fp32 gradients (4),
fp32 master weights and two fp32 moments (12): 18 bytes per parameter when nothing is
sharded. ZeRO-1 shards the 12, ZeRO-2 also the gradients, ZeRO-3 everything.

Activations follow Korthikanti et al. (published-figures.md section 3), generalised to
grouped-query attention, gated MLPs and experts by counting each stored tensor:
  norms: the two norm inputs, 4sbh;  attention: its input 2sbh, q 2sbh, k and v 4 s b h_kv,
  the output projection's input 2sbh;  plain GeLU MLP: input 2sbh, two 2sbf tensors;
  SwiGLU: input 2sbh, four 2sbf tensors (w1 out, w3 out, silu out, product);
  MoE: input 2sbh, per routed copy (k per token) the rows the experts read 2sbh, their SwiGLU
  8sbf, the rows they return 2sbh;
  GPT-style (GeLU) models also keep two 1-byte dropout masks, sbh each (phalanx has none).
For MHA + 4h GeLU that is 34 sbh, as published. Without flash attention the softmax adds
2 a s^2 b (plus 3 a s^2 b of dropout for GPT-style models: the published 5 a s^2 b).
Under tensor parallelism the norm inputs, the attention and MLP inputs and the dropout masks
stay replicated unless sequence parallelism splits them too. The phalanx trainer stores these
same tensors (benchmarks/activation_memory.py measures them against this count), plus a few
small fp32 ones (`phalanx_model`), and in autocast over fp32 weights the copies listed under
`autocast_fp32`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.model.config import ModelConfig
from phalanx.planner import latent_attention

STATE_BYTES = (2, 4, 12)
"""(parameter, gradient, optimizer) bytes per parameter before sharding (`MIXED_ADAM`)."""


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per element of what a training implementation keeps."""

    param: int
    """Resident weights, the copy the optimizer updates (whole, or its shard)."""
    gathered: int
    """A weight gathered by FSDP (its param_dtype) or kept beside an fp32 master copy."""
    grad: int
    optim: int
    """Optimizer state per parameter (Adam's two moments, and a master copy if any)."""
    activation: int
    """A stored activation element; `layer_activation_bytes` counts 16-bit ones."""
    logit: int
    """Per logit element held on the last stage for the loss."""


MIXED_ADAM = Precision(param=2, gathered=2, grad=4, optim=12, activation=2, logit=6)
"""Megatron-style mixed precision: bf16 weights, fp32 gradients, fp32 master weights and moments;
bf16 logits kept beside the fp32 copy the loss reads."""
TRAINER_PRECISION = {
    # phalanx's trainer keeps fp32 weights, which are the master weights in bf16 (no separate
    # master copy), AdamW's two fp32 moments and fp32 gradients (reduced in fp32, or compressed
    # to bf16 only in flight). bf16: the forward computes with bf16 copies (`gathered`): FSDP2's
    # gathered weights, or elsewhere the trainer's own copies, kept for the step
    # (peak_memory.compute_copies). fp32: every activation and the fp32 log-softmax output the
    # loss saves for backward, 4 bytes each.
    "fp32": Precision(param=4, gathered=4, grad=4, optim=8, activation=4, logit=4),
    "bf16": Precision(param=4, gathered=2, grad=4, optim=8, activation=2, logit=4),
}


@dataclass(frozen=True, kw_only=True)
class ParamCounts:
    attention: int
    """Per layer: q, k, v, o projections."""
    dense_mlp: int
    """Per dense layer's feed-forward."""
    experts: int
    """Per MoE layer: all routed experts (sharded over ep)."""
    moe_other: int
    """Per MoE layer: router and shared experts (replicated over ep)."""
    norms: int
    embedding: int
    """One V x h matrix (the input embedding; the output head is another unless tied)."""


def param_counts(model: ModelConfig) -> ParamCounts:
    h, hkv = model.dim, model.n_kv_heads * model.head_dim
    mlp_mats = 3 if model.mlp == "swiglu" else 2
    expert_mats = 3  # routed and shared experts are SwiGLU in the model code
    return ParamCounts(
        attention=latent_attention.attention_params(model) if model.is_latent else 2 * h * h + 2 * h * hkv,
        dense_mlp=mlp_mats * h * model.ffn_dim,
        experts=model.n_experts * expert_mats * h * model.moe_ffn_dim,
        moe_other=h * model.n_experts + model.n_shared_experts * expert_mats * h * model.moe_ffn_dim,
        norms=2 * h,
        embedding=model.vocab_size * h,
    )


def total_params(model: ModelConfig) -> int:
    c = param_counts(model)
    moe_layers = model.n_moe_layers
    dense_layers = model.n_layers - moe_layers
    heads = 1 if model.tie_embeddings else 2
    return (model.n_layers * (c.attention + c.norms) + dense_layers * c.dense_mlp
            + moe_layers * (c.experts + c.moe_other) + heads * c.embedding + model.dim)


def state_bytes_per_param(zero: int, shards: int) -> float:
    """Bytes of parameter + gradient + optimizer state per parameter under a ZeRO level."""
    param, grad, optim = STATE_BYTES
    if zero == 0:
        return param + grad + optim
    if zero == 1:
        return param + grad + optim / shards
    if zero == 2:
        return param + (grad + optim) / shards
    return (param + grad + optim) / shards


def layer_activation_bytes(model: ModelConfig, *, seq: int, mbs: int, tp: int, sp: bool, recompute: str,
                           moe: bool, flash: bool = True, sp_regather: bool = True, fused_norm: bool = True,
                           phalanx_model: bool = False, autocast_fp32: bool = False,
                           wide_norms: bool = False, tp_splits_experts: bool = True,
                           fold_experts: bool = False, cp: int = 1) -> float:
    """Activation bytes one layer keeps for backward for one micro-batch on one device.

    recompute: "full" keeps the layer's input only; "selective" (Korthikanti et al.'s, the
    trainer's since issue 20: the attention core recomputed) keeps everything else, so it
    differs from "none" only by the core's softmax-sized tensors, which flash attention never
    stores.
    sp_regather: with sp, the attention and MLP inputs are kept sharded and gathered again in
    backward (Megatron, the published formula, and the phalanx trainer:
    parallel/sequence_parallel.py). False: the gathered inputs are kept whole, 4 s b h bytes not
    divided by tp.
    fused_norm: False where RMSNorm is torch's CPU composite, which also saves the normalized
    input of each of the two norms: 4 s b h more (`Options.fused_norm`; the phalanx trainer's own
    RMSNorm, model/rms_norm.py, saves input and rstd only on every device).
    phalanx_model: the small tensors phalanx's model keeps that the published count leaves out
    (benchmarks/activation_memory.py measures them): each norm's fp32 rstd, 4 bytes per token, and,
    where the attention core is not recomputed, flash attention's fp32 log-sum-exp, 4 bytes per
    head and token. (k and v are kept at n_kv_heads, as counted: scaled_dot_product_attention with
    enable_gqa does not repeat them; the MoE combine keeps only the expert rows it needs,
    model/moe.py `WeightedCombine`.)
    autocast_fp32: a 16-bit run by autocast over fp32 weights (phalanx's trainer with param_dtype=fp32
    under --dtype bf16, which the planner does not plan for): the residual stream stays fp32, so a fully
    recomputed layer's kept input is twice as wide, and the norms' fp32 outputs are cast once per
    linear that reads them (autocast caches only weights): q, k and v save three 16-bit copies of
    the attention input, SwiGLU's w1 and w3 two of the MLP input (benchmarks/activation_probe.py
    --dtype bf16 lists them).
    wide_norms: in a 16-bit run, the norms' saved tensors are fp32: their input is the fp32
    residual stream (autocast_fp32), or torch's composite RMSNorm (CPU) upcasts a 16-bit input to
    fp32 before it saves x and x / rms.
    tp_splits_experts: False where the MoE block stays out of tp (the phalanx trainer,
    parallel/tensor_parallel.apply_tp): every tp rank routes all the micro-batch's tokens through
    its own whole experts, so the block's activations are not divided by tp.
    fold_experts: the trainer's ep_over_tp=true (MoE parallel folding): each tp rank computes 1/tp
    of the routed rows, so the routed experts' activations are divided by tp; the rows gathered
    back over tp (saved by the weighting multiply) and the shared experts' stay whole.
    cp: context parallelism keeps seq / cp of each sequence's positions on a rank, and every
    tensor above counts those, except keys and values: attention saves the whole sequence's,
    gathered over the cp ranks, for backward (4 seq b h_kv; parallel/context_parallel.py).
    """
    s, b, h = seq // cp, mbs, model.dim
    sbh = s * b * h
    if recompute == "full":
        return (4 if autocast_fp32 else 2) * sbh / (tp if sp else 1)  # only the layer input is kept
    hkv = model.n_kv_heads * model.head_dim
    # GPT-style models train with dropout in the published runs; Llama-style ones and phalanx's without.
    dropout = model.mlp == "gelu" and not phalanx_model
    replicated = (4 + 2 + 2 + (2 if dropout else 0)) * sbh  # norm and block inputs, masks
    if not fused_norm:  # each norm's x / rms, saved for the multiply by its weight
        replicated += 4 * sbh
    if wide_norms:  # the norms' tensors twice as wide
        replicated += (4 if fused_norm else 8) * sbh
    split = 2 * sbh + 4 * seq * b * hkv + 2 * sbh  # q, k and v (the whole sequence's), output projection input
    if model.is_latent:  # latents replicated, decompressed heads split (planner/latent_attention.py)
        latent_replicated, split = latent_attention.training_activation_bytes(model, seq=s, mbs=b)
        replicated += latent_replicated
    whole = 0.0
    if phalanx_model:
        replicated += 2 * 4 * s * b  # the two norms' rstd
        if flash and recompute == "none":
            split += 4 * s * b * model.n_heads  # the log-sum-exp of each head and row
    if sp and not sp_regather:  # the gathered attention and MLP inputs stay whole on every rank
        replicated -= 4 * sbh
        whole = 4 * sbh
    if autocast_fp32:  # q, k, v and w1, w3 each cast their input anew (whole where sp keeps it so)
        casts = 2 * (2 + (1 if model.mlp == "swiglu" and not moe else 0)) * sbh
        if sp and not sp_regather:
            whole += casts
        else:
            replicated += casts
    if moe:
        k, f = model.experts_per_token, model.moe_ffn_dim
        # Each device processes s*b*k routed token copies in total (balanced routing): the rows the
        # experts read, their SwiGLU's four s*b*k*f tensors, the rows they return (which the
        # combine keeps for its weights' gradient).
        block = 2 * s * b * k * h + 8 * s * b * k * f + 2 * s * b * k * h
        # Not counted: the router's fp32 scores (4 s b E bytes) and int64 expert indices (24 s b k),
        # under 5% of a tiny-moe layer and less for wider ones.
        shared = 8 * s * b * f * model.n_shared_experts
        if tp_splits_experts:
            split += block + shared
        elif fold_experts:
            split += block
            whole += 2 * s * b * k * h + shared  # the rows gathered back over tp
        else:
            whole += block + shared
    elif model.mlp == "swiglu":
        split += 8 * s * b * model.ffn_dim
    else:
        split += 4 * s * b * model.ffn_dim
    total = replicated / (tp if sp else 1) + split / tp + whole
    if not flash and recompute == "none":
        total += (5 if dropout else 2) * model.n_heads * s * seq * b / tp
    return total


def in_flight_microbatches(*, schedule: str, pp: int, virtual: int, microbatches: int) -> float:
    """Micro-batches of a whole stage's activations the first stage holds at its peak."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "interleaved":
        return min(float(microbatches), pp * (1 + (pp - 1) / (pp * virtual)))
    if schedule == "dualpipev":
        # DualPipeV's order (pipeline_orders.py) peaks at 2p + 1 half-stage chunks on every rank.
        return min(float(microbatches), pp + 0.5)
    # 1f1b: p on the first rank; zbv in PyTorch's order: 2p half-stage chunks on every rank.
    return min(float(microbatches), float(pp))


def layers_per_stage(n_layers: int, pp: int, virtual: int) -> int:
    """Layers on the most loaded pipeline rank (chunks of ceil(L / (pp * v)) layers)."""
    return virtual * math.ceil(n_layers / (pp * virtual))


GATHERED_LAYERS = 2
"""Layers whose gathered weights FSDP (zero 3) holds at once outside pp: the one running, in
the parameters, and the next, whose all-gather output is already allocated by FSDP2's default
prefetch of one unit (forward implicitly, backward `_backward_prefetch`), in the communication
buffers (peak_memory.py): until its own turn it is an all-gather buffer, not a parameter."""


def state_bytes(*, zero: int, shards: int, params: float, layer_params: float, microbatches: int,
                pp: int, precision: Precision = MIXED_ADAM, offload: bool = False,
                root_params: float = 0.0, reduce_each_microbatch: bool = False) -> dict[str, float]:
    """Parameter, gradient and optimizer bytes of `params` parameters (a rank's stage, over tp)
    sharded `shards` ways at a ZeRO level, as the time model's collectives run them.

    The time model reduces gradients once per step after the last micro-batch (zero 0 and 1
    always; zero 2 and 3 whenever there is more than one micro-batch: the trainer turns
    gradient sync off for all but the last), so the fp32 gradients of the whole stage
    accumulate unsharded for the step. With one micro-batch, zero 2 and 3 reduce-scatter
    during backward: sharded gradients plus one layer's unsharded ones (FSDP2's post-backward
    hook, which runs when each unit's backward ends, copies the unit's gradients into the
    reduce-scatter input and drops them: `_fsdp_param_group.post_backward`, torch 2.13; that
    input is counted with the communication buffers). That unit's own shard does not exist yet:
    the trainer's zero_grad(set_to_none=True) leaves no gradients, and each unit's reduce-scatter
    creates its sharded ones as backward goes, so the unit counts whole in place of its shard.
    Parameters: zero 0 and 1 hold them whole; zero 2 gathers them once and keeps them through
    backward (whole at the peak, beside the shard); zero 3 holds the running layer gathered and
    `root_params` (the root unit: embedding, final norm, output), which FSDP2 gathers for the
    whole backward: its inputs, token ids, need no gradient, so its post-backward waits for the
    final callback (`_root_post_backward_final_callback`; measured: tiny, dp=2,zero=3 holds the
    root and one block gathered at once) - except under pp, where the trainer keeps the stage gathered for the whole step
    (gathered once per step, the time model's charge). Gathered copies are in
    `precision.gathered`. offload (zero 3): the shards of all three live on the host
    (`offloaded_bytes`); the device keeps the gathered weights and the unsharded gradients.
    """
    param, gathered, grad, optim = precision.param, precision.gathered, precision.grad, precision.optim
    n = max(1, shards)
    if zero == 0:
        return {"parameters": param * params, "gradients": grad * params, "optimizer_state": optim * params}
    # reduce_each_microbatch (Options): zero 2 and 3 reduce-scatter after every micro-batch, so the
    # gradients accumulate in their shards, as with a single micro-batch.
    accumulate = zero <= 1 or (microbatches > 1 and not reduce_each_microbatch)
    sharded = 0.0 if offload else 1.0
    # Autograd makes a gathered weight's gradient in its dtype (param_dtype); FSDP2 casts it to the
    # reduce dtype only when it copies it into the reduce-scatter input, or when it accumulates it
    # across micro-batches (`accumulate_unsharded_grad_if_needed`, in the reduce dtype: grad bytes).
    gradients = grad * params if accumulate else grad * sharded * (params - layer_params) / n + gathered * layer_params
    if zero == 1:
        parameters = param * params
    elif zero == 2 or pp > 1:
        parameters = sharded * param * params / n + gathered * params
    else:
        parameters = sharded * param * params / n + gathered * (layer_params + root_params)
    return {"parameters": parameters, "gradients": gradients, "optimizer_state": sharded * optim * params / n}


def offloaded_bytes(*, shards: int, params: float, precision: Precision = MIXED_ADAM) -> dict[str, float]:
    """Host bytes under offload=true (zero 3): the shards of the weights, gradients and optimizer
    state (FSDP2's CPUOffloadPolicy; the optimizer steps on the host)."""
    n = max(1, shards)
    return {"parameters": precision.param * params / n, "gradients": precision.grad * params / n,
            "optimizer_state": precision.optim * params / n}

