"""The serving step model: how long one engine step takes on one rank, torch-free.

`step_time(model, cluster, layout, decodes=B, context=C, prefill_tokens=P)` is the function
other code calls (the serving planner's search, its simulator, an SLO scheduler): one forward
of B decoding sequences of mean context C plus P prompt tokens on one dp rank of `layout`.

Per layer of the most loaded pipeline stage, on one device:
  Weights are read from HBM once per step, whatever the batch: attention and dense
    feed-forwards split over tp, routed experts over ep x tp, and of those only the experts
    some token of the step chose (a step's tokens over the ep group, each choosing k of E,
    touch E/ep (1 - (1 - k/E)^T) of a rank's experts). Each linear costs, on a GPU, the
    roofline of its kernel's bytes and FLOPs (`gpu_gemm_time`, checked against published
    kernel timings), on this CPU max(its weight bytes / bandwidth, the training planner's
    `stage_time.gemm_time`), plus one launch's fill: decode is bound by the bytes, a long
    prefill by the FLOPs. The routed experts run as one grouped GEMM whose FLOPs also pay for
    few rows per group (DeepGEMM's grouped tables).
  Element-wise passes (GPUs, `ServeCosts.elementwise_passes`): each token's activations
    written and read once at the streaming bandwidth, the training planner's count.
  The attention core reads every decoding sequence's KV cache once: the model's real cache
    (`kv_cache_values_per_token`: grouped-query attention's KV heads, of which a tp rank holds
    n_kv/tp, or latent attention's one latent of kv_lora_rank + qk_rope_head_dim values, the
    same on every tp rank) and computes 2 C heads (dk + dv) FLOPs per token (latent
    attention absorbed, as every MLA serving kernel runs it: dk = kv_lora_rank + rope,
    dv = kv_lora_rank); prompt tokens attend causally to their prefix (heads x head_dims
    decompressed). Each side costs max(bytes / bandwidth, FLOPs / attention peak), a GPU's
    grouped-query decode kernel reading at `DECODE_ATTENTION_HBM_FRACTION` of the datasheet
    bandwidth (TensorRT-LLM's decode kernels as published), not the weights' streaming rate.
  TP: two all-reduces per layer of the step's tokens x dim (comm.all_reduce).
  EP: dispatch (fp8 under fp8/fp4 weights, as DeepEP sends it, else the activations' dtype)
    and combine (activations' dtype) of T k dim per MoE layer, an all-to-all over the ep
    group whose members are tp ranks apart (comm.all_to_all: inside the NVLink domain or
    through each GPU's NIC).
  PP: one send of the tokens' activations per stage boundary (comm.send).
Framework costs (`ServeCosts`, named where they are set): a fixed host cost per step
(scheduling, sampling, detokenization), per layer (kernel launches without CUDA graphs,
Python), per sequence and per sequence-layer (phalanx's paged cache gathers each sequence's
keys per layer), per forward of a tp group; zero on the GPU presets but for the step's host
cost, measured on this CPU. `phalanx serve` runs a step's decodes and prompt chunks as two
forwards (`ServeCosts.split_forwards`): a step with both costs both forwards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from phalanx.model.config import ModelConfig
from phalanx.planner import comm, latent_attention
from phalanx.planner.hardware import Cluster
from phalanx.planner.kv_cache import kv_bytes_per_token
from phalanx.planner.memory import layer_activation_bytes
from phalanx.planner.serve.costs import ServeCosts, serve_costs_for
from phalanx.planner.stage_time import GEMM_TILE, gemm_time

WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "fp4": 0.5 + 1 / 16}
"""Bytes per weight: fp4 (NVFP4) keeps one fp8 scale per 16 values."""
KV_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0}


@dataclass(frozen=True, kw_only=True)
class ServeLayout:
    """One serving instance's layout: dp ranks (attention data parallelism: each runs its own
    sequences) of tp x pp devices; ep (carved from dp, as in training) spreads the routed
    experts, which tp splits further. Devices per instance: dp x tp x pp."""
    tp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    slots: int = 0
    """Routed-expert slots per MoE layer over the ep group (`phalanx serve --expert-slots`):
    each ep rank holds slots / ep of them, hot experts replicated; 0: one slot per expert."""
    expert_imbalance: float = 0.0
    """(max - mean) / mean of the routed rows over the ep ranks that the slots' placement leaves
    for the plan's expert load (serve/expert_load.expected_imbalance): the most loaded rank
    computes, receives and returns 1 + this times the mean rows."""

    def slot_count(self, n_experts: int) -> int:
        return self.slots or n_experts

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def plan_string(self) -> str:
        """The layout in `--plan` grammar (phalanx serve's)."""
        parts = [f"{k}={getattr(self, k)}" for k in ("dp", "tp", "pp", "ep") if getattr(self, k) > 1]
        return ",".join(parts) or "dp=1"


@dataclass(frozen=True)
class StepTime:
    """One step's predicted seconds, by cause (they sum to `seconds`)."""
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(self.breakdown.values())


def act_bytes(layout: ServeLayout) -> float:
    """Activations run in the weights' compute dtype: fp32 where the weights are (this CPU),
    else bf16 (fp8/fp4 GEMMs take bf16 activations quantized on the fly)."""
    return 4.0 if layout.weight_dtype == "fp32" else 2.0


NVFP4_OVER_FP8 = (1.5 + 2.2) / 2
"""What an NVFP4 (W4A4) GEMM reaches over an fp8 one on Blackwell: NVIDIA's Nemotron 3 Super
quantization page (docs.nvidia.com/nemotron/latest/nemotron/super3/quantization.html) gives
"1.5-2.2x higher GEMM FLOPS than FP8" for its NVFP4 checkpoint on B200; the middle of that
range. The datasheets' dense fp4 peak is twice the fp8 one, which real W4A4 GEMMs do not reach:
each quantizes its bf16 activations to fp4 with a scale per 16 values on the way in, and the
block scales take their own passes through the tensor cores' pipeline."""


def gemm_peak(cluster: Cluster, dtype: str, world: int) -> float:
    """FLOP/s of one rank's GEMMs in the weights' dtype (fp8/fp4 tensor cores where present):
    fp4 at `NVFP4_OVER_FP8` times the fp8 rate, at most the datasheet's fp4 peak."""
    base = cluster.peak_flops_per_rank(world)
    if dtype == "fp8" and cluster.fp8_tflops:
        return base * cluster.fp8_tflops / cluster.peak_tflops
    if dtype == "fp4" and cluster.fp4_tflops:
        fp4 = min(cluster.fp4_tflops, NVFP4_OVER_FP8 * cluster.fp8_tflops) if cluster.fp8_tflops else cluster.fp4_tflops
        return base * fp4 / cluster.peak_tflops
    return base


def kv_bytes_per_token_layer(model: ModelConfig, layout: ServeLayout) -> float:
    """One token's cache in one layer on one tp rank: GQA's KV heads split over tp (replicated
    past n_kv_heads ranks); latent attention's single latent, whole on every tp rank."""
    return kv_bytes_per_token(model, bytes_per_value=KV_BYTES[layout.kv_dtype], tp=layout.tp, layers=1)


@functools.lru_cache(maxsize=256)
def stage_layers(model: ModelConfig, pp: int) -> tuple[int, int]:
    """(layers, MoE layers) of the most loaded pipeline stage (cached: counting the MoE layers
    walks every layer, and a search asks thousands of times)."""
    layers = math.ceil(model.n_layers / pp)
    return layers, math.ceil(model.n_moe_layers / pp)


def active_experts_per_rank(model: ModelConfig, layout: ServeLayout, tokens: float) -> float:
    """Expected distinct routed expert slots of the most loaded rank that `tokens` per dp rank
    touch in a step (every ep member's tokens reach every member's slots): of its S / ep slots,
    each untouched by one of the group's tokens with probability 1 - k / S (its share of the
    k choices, a replica taking its share of its expert's rows), the rank's share of the
    tokens 1 + imbalance times the mean. One slot per expert and even loads: E / ep (1 - (1 -
    k / E)^(tokens ep))."""
    if not model.n_experts or tokens <= 0:
        return 0.0
    s, k = layout.slot_count(model.n_experts), model.experts_per_token
    group_tokens = tokens * layout.ep * (1 + layout.expert_imbalance)
    return s / layout.ep * (1 - (1 - k / s) ** group_tokens)


@functools.lru_cache(maxsize=256)
def activation_bytes_per_token(model: ModelConfig, tp: int) -> tuple[float, float]:
    """(dense layer, MoE layer) bytes of 16-bit activations one token's forward writes on a tp
    rank (the training planner's count, `memory.layer_activation_bytes`, without sequence
    parallelism: norm and block inputs whole, attention and feed-forward tensors over tp, the
    routed rows k copies of the token, whole on every tp rank)."""
    one = functools.partial(layer_activation_bytes, model, seq=1, mbs=1, tp=tp, sp=False, recompute="none", flash=True)
    if not model.n_experts:
        return one(moe=False), 0.0
    # The training count divides the routed rows (2 k h bytes in, 2 k h out) over tp with the
    # rest of the block; a serving tp rank runs its 1/tp slice of every expert on every routed
    # row (TensorRT-LLM's and vLLM's tensor-parallel MoE), so it permutes and returns them whole.
    rows = 4 * model.experts_per_token * model.dim
    return one(moe=False), one(moe=True) + rows * (1 - 1 / tp)


def _fill(d: float, half: float) -> float:
    return d / (d + half)


def _grouped_gemm_time(cluster: Cluster, peak: float, groups: float, rows: float, n: float, k: float) -> float:
    """Seconds of one grouped GEMM: `groups` products of (rows x k)(k x n) in one launch. Each
    group's output has its own tiles (ceil(rows/128) x ceil(n/256), or transposed), and all
    groups' tiles share the SMs' waves; the small-dimension charge is each group's."""
    half = cluster.matmul_half_dim
    eff = cluster.matmul_efficiency * _fill(rows, half) * _fill(n, half) * _fill(k, half)
    if cluster.sm_count > 0:
        best = 0.0
        for tm, tn in (GEMM_TILE, GEMM_TILE[::-1]):
            tiles = math.ceil(groups) * math.ceil(rows / tm) * math.ceil(n / tn)
            best = max(best, tiles / (math.ceil(tiles / cluster.sm_count) * cluster.sm_count))
        eff *= best
    return 2.0 * groups * rows * n * k / (peak * eff)


DECODE_ATTENTION_HBM_FRACTION = (0.60 + 0.75) / 2
"""The share of a GPU's datasheet HBM bandwidth at which a serving engine's grouped-query decode
attention kernel streams the KV cache of a large batch: FlashInfer pull request 4904 (2026-09)
found TensorRT-LLM's XQA kernel (Hopper, fp8 KV cache, head_dim 128, paged, under a CUDA graph)
running large-batch decode "at 60-75% of bandwidth" (its split-KV grid collapses to one CTA per
(sequence, KV head) once batch x KV heads passes about 50; e.g. 8 query heads over 1 KV head,
batch 32, 32,768 positions: 111.9 us for 268 MB, 2.4 TB/s on a GH200), and FlashInfer pull
request 1415 times TensorRT-LLM's trtllm-gen decode kernel on a B200 (64 query and 8 KV heads,
page 16) at batch 128 with 1,024 and 4,096 positions at 4,915 and 5,831 GB/s, 0.61 and 0.73 of
its 8 TB/s. The middle of 0.60 to 0.75. The GEMMs stream at the presets' 0.9 (`hbm_efficiency`,
a device-to-device copy); latent attention keeps it too: FlashMLA's README gives "up to 3000
GB/s" on an H800 (0.90 of 3.35 TB/s), the kernel's own figure."""


GEMM_OUT_BYTES = 2.0
"""A GEMM's output is bf16 (the fp8 and fp4 GEMMs dequantize into it)."""


def gpu_gemm_time(cluster: Cluster, peak: float, bw: float, groups: float, rows: float, n: float, k: float,
                  wbytes: float, *, moe_grouped: bool = False) -> float:
    """Seconds of `groups` (rows x k)(k x n) GEMMs in one launch on a GPU, a roofline of the
    kernel's bytes and FLOPs: the weights, the inputs (in the weights' dtype: W16A16, W8A8 and
    NVFP4's W4A4 quantize the activations on the way in) and the bf16 outputs at the streaming
    bandwidth, or the FLOPs at `matmul_efficiency` of the dtype's peak, charged for a small n or
    k (f(d) = d / (d + matmul_half_dim), the training planner's) and, once the output's 128 x 256
    tiles fill at least one wave of the SMs, for the last wave's idle SMs. No charge for few
    rows, nor for an output of fewer tiles than SMs: decode-size kernels take smaller tiles or
    split k and stream the weights near the bandwidth. Checked against published kernel
    timings (`benchmarks/serve_planner_published.py --kernels`): DeepGEMM's fp8 GEMMs on an H800
    (its README at 7a70b43, 18 dense rows) and vLLM's per-tensor fp8 CUTLASS GEMMs on Llama 3.1
    8B's qkv shape on H100 and B200 (vLLM pull requests 17126 and 18778). The training
    planner's `gemm_time`, which charges f(rows) and the large tiles' waves at any size, ran
    their 16 to 256 row GEMMs 1.3 to 4x slower than published; it matches only DeepSeek's own
    CUTLASS 3.6 baseline for block-scaled fp8, which DeepGEMM beats 1.4 to 2.7x there.

    `moe_grouped`: an MoE layer's experts as one grouped GEMM of `rows` per group, whose FLOPs
    are also charged f(rows): DeepGEMM's grouped tables (its README at 7a70b43, H800, fp8) run
    the same N and K at 1,233 TFLOP/s with 1,024 rows per group, 1,040 with 512 and 932 with
    256 (4,096 x 7,168; 925, 916 and 815 at 7,168 x 2,048), where the uncharged roofline gives
    one rate for all three: it ran those ten grouped GEMMs a median 0.90 of their published
    time (0.75 to 1.00), charged f(rows) 1.02 (0.87 to 1.11;
    `benchmarks/serve_planner_published.py --kernels`). Dense GEMMs stay uncharged (vLLM's and
    DeepGEMM's dense tables above)."""
    half = cluster.matmul_half_dim
    eff = cluster.matmul_efficiency * _fill(n, half) * _fill(k, half)
    if moe_grouped:
        eff *= _fill(rows, half)
    tiles_min, wave = math.inf, 0.0
    for tm, tn in (GEMM_TILE, GEMM_TILE[::-1]):
        tiles = math.ceil(groups) * math.ceil(rows / tm) * math.ceil(n / tn)
        tiles_min = min(tiles_min, tiles)
        wave = max(wave, tiles / (math.ceil(tiles / cluster.sm_count) * cluster.sm_count))
    if tiles_min >= cluster.sm_count:
        eff *= wave
    nbytes = groups * (n * k * wbytes + rows * k * wbytes + rows * n * GEMM_OUT_BYTES)
    return max(nbytes / bw, 2.0 * groups * rows * n * k / (peak * eff))


def _linear(cluster: Cluster, peak: float, bw: float, rows: float, shapes, wbytes: float, copies: float = 1.0,
            *, grouped: bool = False) -> float:
    """`copies` x the GEMMs of `shapes` ((n, k) each) over `rows` token rows: the weights'
    bytes or the GEMM's time, whichever is longer (roofline), summed. Copies are layers run
    one after another, or with `grouped` experts run as one grouped GEMM (as MoE kernels do):
    their output tiles fill the SMs' waves together, so the wave fill is that of copies x rows
    rows, while the small-dimension charge stays that of `rows`. On a GPU (`sm_count` > 0)
    each is `gpu_gemm_time`; on this CPU the training planner's GEMM, as calibrated."""
    total = 0.0
    for n, k in shapes:
        if cluster.sm_count > 0:
            groups = copies if grouped else 1.0
            total += gpu_gemm_time(cluster, peak, bw, groups, rows, n, k, wbytes, moe_grouped=grouped) / groups \
                if rows > 0 else \
                n * k * wbytes / bw
            continue
        read = n * k * wbytes / bw
        compute = 0.0
        if rows > 0 and grouped:
            compute = _grouped_gemm_time(cluster, peak, copies, rows, n, k) / copies
        elif rows > 0:
            compute = gemm_time(rows, n, k, cluster=cluster, peak=peak)
        total += max(read, compute)
    return copies * total


def one_gemm_time(cluster: Cluster, dtype: str, rows: float, n: float, k: float, *, costs: ServeCosts) -> float:
    """Seconds the step model gives one (rows x k)(k x n) GEMM with weights in `dtype` on one
    device: its roofline (`_linear`) plus its launch's fill and drain (`costs.gemm_fill`); what
    benchmarks/serve_planner_published.py --kernels sets beside published kernel timings."""
    peak = gemm_peak(cluster, dtype, 1) * costs.flops_scale
    bw = cluster.memory_bw_per_rank(1) * costs.bandwidth_scale
    return _linear(cluster, peak, bw, rows, [(n, k)], WEIGHT_BYTES[dtype]) + costs.gemm_fill(dtype)


def step_time(model: ModelConfig, cluster: Cluster, layout: ServeLayout, *, decodes: float, context: float,
              prefill_tokens: float = 0.0, prefill_context: float | None = None, world: int | None = None,
              costs: ServeCosts | None = None, shares: tuple[float, float] = (1.0, 1.0)) -> StepTime:
    """Seconds of one engine step on one dp rank: `decodes` sequences of mean `context` tokens
    each decoding one token, plus `prefill_tokens` prompt tokens whose prefix is
    `prefill_context` tokens on average (default: half a chunk, i.e. a fresh prompt). `world`:
    devices sharing one CPU node (shared_compute; default the layout's). Pipeline parallelism:
    the time of one stage for this rank's batch (the caller splits the batch into pp
    micro-batches).

    Under an engine that runs decodes and prompt chunks as separate forwards
    (`costs.split_forwards`, phalanx serve) a step holding both is the two forwards' time, the
    per-step host cost (`step_s`) once. `shares` (decode, prompt): for a mean step of a load
    (serve/rates.py), the share of steps that hold each forward, its tokens then coming in that
    share of the steps: every per-forward cost scales with the share, every per-token and
    per-sequence cost stays (a step with a fifth of a prompt's tokens on average is a prompt
    forward one step in five, not a fifth-size forward every step)."""
    costs = costs or serve_costs_for(cluster)
    if not (costs.split_forwards and decodes > 0 and prefill_tokens > 0):
        return _host_bound(_forward_time(model, cluster, layout, decodes=decodes, context=context,
                                         prefill_tokens=prefill_tokens, prefill_context=prefill_context, world=world,
                                         costs=costs), cluster, costs, decodes + (1 if prefill_tokens else 0))
    per_forward = dataclasses.replace(costs, step_s=0.0)
    d_share, p_share = (min(max(x, 1e-9), 1.0) for x in shares)
    dec = _forward_time(model, cluster, layout, decodes=decodes / d_share, context=context, world=world,
                        costs=per_forward)
    pre = _forward_time(model, cluster, layout, decodes=0.0, context=0.0, prefill_tokens=prefill_tokens / p_share,
                        prefill_context=prefill_context, world=world, costs=per_forward)
    parts = {k: d_share * dec.breakdown[k] + p_share * pre.breakdown[k] for k in dec.breakdown}
    parts["framework"] += costs.step_s
    return _host_bound(StepTime(parts), cluster, costs, decodes + p_share)


def _host_bound(step: StepTime, cluster: Cluster, costs: ServeCosts, sequences: float) -> StepTime:
    """The step under an engine that overlaps its host work with the GPU's
    (`ServeCosts.host_sequence_s`): the longer of the two; what the host adds beyond the GPU's
    step is its own cause, `host`."""
    host = costs.host_sequence_s * cluster.host_cpu_slowdown * sequences
    return StepTime({**step.breakdown, "host": max(0.0, host - step.seconds)})


def _forward_time(model: ModelConfig, cluster: Cluster, layout: ServeLayout, *, decodes: float, context: float,
                  prefill_tokens: float = 0.0, prefill_context: float | None = None, world: int | None = None,
                  costs: ServeCosts) -> StepTime:
    """One forward of `decodes` decoding sequences and `prefill_tokens` prompt tokens (as in
    `step_time`), with every cost once."""
    world = world or layout.gpus
    tp, ab = layout.tp, act_bytes(layout)
    wb = WEIGHT_BYTES[layout.weight_dtype]
    peak = gemm_peak(cluster, layout.weight_dtype, world) * costs.flops_scale
    bw = cluster.memory_bw_per_rank(world) * costs.bandwidth_scale
    attn_peak = cluster.peak_flops_per_rank(world) * cluster.attention_efficiency * costs.flops_scale
    tokens = decodes + prefill_tokens
    layers, moe_layers = stage_layers(model, layout.pp)
    dense_layers = layers - moe_layers
    h = model.dim

    attention = _linear(cluster, peak, bw, tokens, latent_attention.gemm_shapes(model, tp), wb, layers)
    f = model.ffn_dim
    mlp_shapes = [(2 * f / tp, h), (h, f / tp)] if model.mlp == "swiglu" else [(f / tp, h), (h, f / tp)]
    dense = _linear(cluster, peak, bw, tokens, mlp_shapes, wb, dense_layers)
    experts = 0.0
    if moe_layers:
        fe = model.moe_ffn_dim
        shared = model.n_shared_experts
        expert_shapes = [(2 * fe / tp, h), (h, fe / tp)]
        router = _linear(cluster, peak, bw, tokens, [(model.n_experts, h)], wb)
        shared_t = _linear(cluster, peak, bw, tokens, [(2 * shared * fe / tp, h), (h, shared * fe / tp)], wb) if shared else 0.0
        active = active_experts_per_rank(model, layout, tokens)
        # The most loaded rank's routed rows: its ep group's tokens x k spread over ep ranks =
        # tokens x k on the mean rank, 1 + imbalance times that on the most loaded, over its
        # active slots.
        hot = 1 + layout.expert_imbalance
        rows_per_expert = tokens * model.experts_per_token * hot / max(active, 1e-9)
        routed = _linear(cluster, peak, bw, rows_per_expert, expert_shapes, wb, active, grouped=True)
        experts = moe_layers * (router + shared_t + routed)
    head = _linear(cluster, peak, bw, min(tokens, decodes + (1 if prefill_tokens else 0)),
                   [(model.vocab_size / tp, h)], wb)
    # Each GEMM launched also fills and drains its pipeline (ServeCosts.gemm_fill): one launch per
    # shape per layer, the routed experts' two as grouped GEMMs, the router, shared experts, head.
    launches = (layers * len(latent_attention.gemm_shapes(model, tp)) + dense_layers * len(mlp_shapes)
                + moe_layers * (1 + (2 if model.n_shared_experts else 0) + 2) + 1)

    kv_layer = kv_bytes_per_token_layer(model, layout)
    heads = model.n_heads / tp
    if model.is_latent:  # absorbed MLA for decode: scores over the latent + rope, values over the latent
        dec_width = heads * (model.kv_lora_rank + model.qk_rope_head_dim + model.kv_lora_rank)
    else:
        dec_width = heads * (model.head_dim + model.value_dim)
    # A GPU's grouped-query decode attention kernel streams the KV cache below the plain
    # streaming rate (DECODE_ATTENTION_HBM_FRACTION of the datasheet bandwidth); latent
    # attention's kernels and this CPU's calibrated rate stay at `bw`.
    gqa_gpu = cluster.sm_count > 0 and not model.is_latent
    kv_bw = bw * DECODE_ATTENTION_HBM_FRACTION / cluster.hbm_efficiency if gqa_gpu else bw
    dec_attn = layers * max(decodes * context * kv_layer / kv_bw, 2 * decodes * context * dec_width / attn_peak)
    pre_ctx = prefill_context if prefill_context is not None else prefill_tokens / 2
    pre_width = heads * (model.head_dim + model.value_dim)
    pre_attn = layers * 2 * prefill_tokens * pre_ctx * pre_width / attn_peak if prefill_tokens else 0.0

    tp_comm = layers * 2 * comm.all_reduce(cluster, tokens * h * ab, size=tp, stride=1) if tp > 1 else 0.0
    ep_comm = 0.0
    if moe_layers and layout.ep > 1:
        k = model.experts_per_token
        dispatch_bytes = 1.0 if layout.weight_dtype in ("fp8", "fp4") else ab
        rows = tokens * k * h / tp * (1 + layout.expert_imbalance)  # the most loaded rank's
        ep_comm = moe_layers * (comm.all_to_all(cluster, rows * dispatch_bytes, size=layout.ep, stride=tp)
                                + comm.all_to_all(cluster, rows * ab, size=layout.ep, stride=tp))
    pp_comm = 0.0
    if layout.pp > 1:
        same = tp * layout.dp * 2 <= cluster.fast_domain
        pp_comm = comm.send(cluster, tokens * h * ab, same_domain=same)
    elementwise = 0.0
    if costs.elementwise_passes and tokens > 0:
        # Each element-wise pass reads and writes its activations (2x), as the training
        # planner's forward charges them (stage_time.layer_cost), at the streaming bandwidth.
        dense_bytes, moe_bytes = activation_bytes_per_token(model, tp)
        elementwise = 2 * tokens * (dense_layers * dense_bytes + moe_layers * moe_bytes) / (
            bw * cluster.elementwise_efficiency)
    sequences = decodes + (1 if prefill_tokens else 0)
    framework = (costs.step_s + costs.group_step(tp) + layers * costs.layer_s + sequences * costs.sequence_s
                 + decodes * layers * costs.sequence_layer_s + tokens * costs.token_s)
    return StepTime({
        "weights_and_gemms": attention + dense + experts + head + launches * costs.gemm_fill(layout.weight_dtype),
        "attention_decode": dec_attn, "attention_prefill": pre_attn,
        "elementwise": elementwise, "tp_comm": tp_comm, "ep_comm": ep_comm, "pp_comm": pp_comm,
        "framework": framework,
    })


def decode_step_time(model: ModelConfig, cluster: Cluster, layout: ServeLayout, *, batch: int, context: float,
                     world: int | None = None, costs: ServeCosts | None = None) -> float:
    """Seconds per output token of `batch` sequences at mean `context` decoding alone on one
    dp rank (no prompt in the step): the pp stages in turn, each on batch / pp sequences."""
    micro = batch / layout.pp
    return layout.pp * step_time(model, cluster, layout, decodes=micro, context=context, world=world,
                                 costs=costs).seconds


def prefill_step_time(model: ModelConfig, cluster: Cluster, layout: ServeLayout, *, tokens: int, context: float = 0.0,
                      world: int | None = None, costs: ServeCosts | None = None) -> float:
    """Seconds to run `tokens` prompt tokens (after `context` cached ones) through one dp rank,
    through all pp stages, alone in the step."""
    return layout.pp * step_time(model, cluster, layout, decodes=0, context=0, prefill_tokens=tokens,
                                 prefill_context=context + tokens / 2, world=world, costs=costs).seconds
