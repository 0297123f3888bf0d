"""Multi-head latent attention (DeepSeek-V2/V3) in the planner: parameters, GEMM shapes,
training activations tensor by tensor, and the serving KV cache per token. Torch-free.

Grouped-query attention's formulas (q, k, v and o of h x heads x head_dim) overcount latent
attention ~2.4x for DeepSeek-V3; these follow phalanx/model/latent_attention.py matrix by
matrix. Under tensor parallelism the up-projections and the output projection are split by
heads, the down-projections and latent norms replicated (parallel/latent_tp.py).
"""

from __future__ import annotations

from phalanx.model.config import ModelConfig
from phalanx.planner.kv_cache import kv_bytes_per_token

BF16 = 2


def attention_params(model: ModelConfig) -> int:
    """Parameters of one layer's latent attention (without its input norm)."""
    h, heads = model.dim, model.n_heads
    queries = (h * model.q_lora_rank + model.q_lora_rank + model.q_lora_rank * heads * model.head_dim
               if model.q_lora_rank else h * heads * model.head_dim)
    latent = h * (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank
    up = model.kv_lora_rank * heads * (model.qk_nope_head_dim + model.v_head_dim)
    return queries + latent + up + heads * model.v_head_dim * h


def gemm_shapes(model: ModelConfig, tp: int) -> list[tuple[float, float]]:
    """(n, k) of each attention GEMM per token row on one tp rank: (tokens x k)(k x n)."""
    h, heads = model.dim, model.n_heads
    if not model.is_latent:
        hq, hkv = heads * model.head_dim, model.n_kv_heads * model.head_dim
        return [((hq + 2 * hkv) / tp, h), (h, hq / tp)]
    qk = heads * model.head_dim
    shapes = ([(model.q_lora_rank, h), (qk / tp, model.q_lora_rank)] if model.q_lora_rank else [(qk / tp, h)])
    return shapes + [(model.kv_lora_rank + model.qk_rope_head_dim, h),
                     (heads * (model.qk_nope_head_dim + model.v_head_dim) / tp, model.kv_lora_rank),
                     (h, heads * model.v_head_dim / tp)]


def core_width(model: ModelConfig) -> float:
    """Channels of the attention core's two products per query, averaged: scores over
    heads x head_dim, the value sum over heads x v_head_dim (4 s^2 x this = its FLOPs)."""
    return model.n_heads * (model.head_dim + model.value_dim) / 2


def training_activation_bytes(model: ModelConfig, *, seq: int, mbs: int) -> tuple[float, float]:
    """(replicated, split over tp) bytes of bf16 activations latent attention keeps for
    backward, beyond the attention input that every attention keeps, tensor by tensor:
    replicated: the query latent before and after its norm (2 x 2 s b q_lora_rank), the
    key/value latent before and after its norm (2 x 2 s b kv_lora_rank) and the rotated key
    part (2 s b qk_rope_head_dim); split by heads: the decompressed queries and keys
    (2 x 2 s b heads head_dim), values (2 s b heads v_head_dim) and the attention output
    that the output projection reads (2 s b heads v_head_dim)."""
    sb = seq * mbs
    replicated = BF16 * sb * (2 * model.q_lora_rank + 2 * model.kv_lora_rank + model.qk_rope_head_dim)
    split = BF16 * sb * model.n_heads * (2 * model.head_dim + 2 * model.v_head_dim)
    return float(replicated), float(split)


def kv_cache_bytes_per_token(model: ModelConfig, *, bytes_per_value: int = BF16) -> int:
    """Serving KV cache per token over all layers: the latent and the rotated key part with
    latent attention (576 values per layer for DeepSeek-V3), keys and values of every KV head
    with grouped-query attention (`ModelConfig.kv_cache_values_per_token`)."""
    return int(kv_bytes_per_token(model, bytes_per_value=bytes_per_value))
