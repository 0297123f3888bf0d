"""What a model's KV cache holds per token, on one tensor-parallel rank: the one definition that
`phalanx serve`'s paged cache sizes its blocks by (serve/paged_cache.kv_channels_per_position)
and the planner prices memory, decode reads and KV transfers by (planner/serve/, the training
half's latent_attention.kv_cache_bytes_per_token), so that the two cannot disagree."""

from __future__ import annotations

from phalanx.model.config import ModelConfig


def kv_values_per_token_layer(model: ModelConfig, tp: int = 1) -> int:
    """Values one tp rank caches per token in one layer: latent attention's latent and rotated
    key (`kv_lora_rank + qk_rope_head_dim`), whole on every rank (parallel/latent_tp.py); else
    the keys and values of the rank's KV heads, n_kv_heads / tp of them, at least one (a group
    wider than the KV heads replicates them)."""
    if model.is_latent:
        return model.kv_cache_values_per_token
    return max(1, model.n_kv_heads // tp) * (model.head_dim + model.value_dim)


def kv_bytes_per_token(model: ModelConfig, *, bytes_per_value: float, tp: int = 1, layers: int | None = None) -> float:
    """Bytes one tp rank caches per token over `layers` layers (default: all of the model's)."""
    return (model.n_layers if layers is None else layers) * kv_values_per_token_layer(model, tp) * bytes_per_value
