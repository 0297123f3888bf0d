"""Multi-head latent attention (DeepSeek-V2/V3), for one device.

Each token's keys and values are rebuilt for every head from one compressed latent of
`kv_lora_rank` channels, plus one rotated key part of `qk_rope_head_dim` channels that all
heads share. Each query and key head is split into a plain part (`qk_nope_head_dim`) and a
rotated part; values have `v_head_dim` channels. Queries pass through their own compressed
latent (`q_lora_rank`) or, with q_lora_rank = 0, one plain projection.

Training (no cache) decompresses keys and values and runs ordinary attention, as
`transformers`' DeepseekV3Attention does. With a cache, only the latent and the rotated key
part are cached, (batch, 1, seq, kv_lora_rank) and (batch, 1, seq, qk_rope_head_dim) through
the `AttentionCache.update` of `kv_cache.py`, and attention runs in the absorbed form: the key
up-projection is folded into the query and the value up-projection applied after attention,
so the cached latent is never decompressed (576 values per token and layer for DeepSeek-V3
instead of 128 heads x (192 + 128)). A prefill (many new queries per key) decompresses the
latents it reads instead, the cheaper product there (as DeepSeek's and SGLang's servers do).

Training under context parallelism or `--doc-mask` takes the cache path too: the "cache" is
then a `SequenceView` (parallel/context_parallel.py) whose `positions` are this rank's absolute
positions and whose `update` returns the latents and rotated keys of the whole sequence,
gathered over the cp ranks, with an attention object in place of a mask (`AttentionCore` calls
its `attend`, which runs the causal and unmasked key blocks); the prefill branch decompresses
them here.
So only the latents travel, never the per-head keys and values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.model.attention_core import AttentionCore
from phalanx.model.config import ModelConfig
from phalanx.model.kv_cache import AttentionCache, attention_mask
from phalanx.model.rotary import apply_rotary, deinterleave, softmax_scale

LATENT_NORM_EPS = 1e-6
"""The eps of the two latent norms: DeepseekV3RMSNorm's default, which transformers uses
for them whatever the config's rms_norm_eps."""


def local_tensor(weight: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a weight (a DTensor under tensor parallelism), else the weight."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class LatentAttention(nn.Module):
    absorbed: bool = True
    """With a cache: cache the latent and attend in the absorbed form (True), or cache the
    decompressed keys and values of every head (False: the reference and the baseline of
    benchmarks/generate_throughput.py)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer, self.scale = layer, softmax_scale(cfg)
        self.core = AttentionCore(self.scale)  # recompute=selective recomputes this alone
        self.nope, self.rope, self.value = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        qk = cfg.n_heads * cfg.head_dim
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.dim, bias=False)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_b") else self.wq(x)
        return q.view(*x.shape[:2], -1, self.nope + self.rope)  # (batch, seq, heads, head_dim)

    def rotate(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return apply_rotary(deinterleave(x) if self.interleave else x, table)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q_nope, q_rope = self.queries(x).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.rank, self.rope], dim=-1)  # (batch, seq, rank), (batch, seq, rope)
        latent = self.kv_norm(latent)
        table = rope[:seq] if cache is None else rope[cache.positions(seq, x.device)]
        q_rope = self.rotate(q_rope, table)
        k_rope = self.rotate(k_rope[:, :, None], table)  # (batch, seq, 1, rope): one head shared by all
        if cache is None:
            out = self.decompressed(q_nope, q_rope, latent, k_rope, attention_mask(seq, seq, 0, x.device))
        elif not self.absorbed:  # the reference: every head's keys and values cached
            out = self.decompressed(q_nope, q_rope, latent, k_rope, None, cache)
        else:
            latents, k_ropes, mask = cache.update(self.layer, latent[:, None], k_rope.transpose(1, 2), 0)
            if seq > 1:  # a prefill (or cp's view): many queries per key, decompressing is the cheaper product
                out = self.decompressed(q_nope, q_rope, latents[:, 0], k_ropes.transpose(1, 2), mask)
            else:
                out = self.absorbed_attention(q_nope, q_rope, latents, k_ropes, mask)  # (batch, heads, seq, value)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))  # (batch, seq, heads * value)

    def decompressed(self, q_nope, q_rope, latent, k_rope, mask, cache: AttentionCache | None = None) -> torch.Tensor:
        """Keys and values decompressed for every head from `latent` (batch, keys, rank) and
        `k_rope` (batch, keys, 1, rope), then ordinary attention with `mask` (None: causal);
        with a `cache`, the decompressed keys and values of the new tokens are what it holds."""
        batch, seq, heads, _ = q_nope.shape
        kv = self.wkv_b(latent).view(batch, latent.shape[1], heads, self.nope + self.value)
        k_nope, v = kv.split([self.nope, self.value], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)  # (batch, heads, seq, head_dim)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1).transpose(1, 2)  # (batch, heads, keys, head_dim)
        v = v.transpose(1, 2)  # (batch, heads, keys, value)
        if cache is not None:
            k, v, mask = cache.update(self.layer, k, v, 0)
        return self.core(q, k, v, mask)

    def absorbed_attention(self, q_nope, q_rope, latents, k_ropes, mask) -> torch.Tensor:
        """Attention over the cached latents (batch, 1, keys, rank) and rotated keys
        (batch, 1, keys, rope) without decompressing them.

        q_nope . (W_uk c) = (W_uk^T q_nope) . c, so each head's plain query is mapped into the
        latent space and attends to the latents directly, its rotated part to the shared
        rotated keys: one key "head" of rank + rope channels serves every query head (as in
        multi-query attention), with the latents themselves as values; the value
        up-projection W_uv is applied to the attention output afterwards. The query heads are
        folded into the query rows of that one head, so the shared keys are never repeated
        per head (as `enable_gqa` may do where no fused kernel takes the shapes)."""
        batch, seq, heads, _ = q_nope.shape
        weight = local_tensor(self.wkv_b.weight).view(heads, self.nope + self.value, self.rank)
        w_uk, w_uv = weight.split([self.nope, self.value], dim=1)  # (heads, nope, rank), (heads, value, rank)
        q_latent = torch.einsum("bshn,hnr->bhsr", q_nope, w_uk)  # (batch, heads, seq, rank)
        q = torch.cat([q_latent, q_rope.transpose(1, 2)], dim=-1)  # (batch, heads, seq, rank + rope)
        keys = torch.cat([latents, k_ropes], dim=-1)  # (batch, 1, keys, rank + rope)
        n_keys = keys.shape[2]
        if mask is None:  # plain causal: the queries are the last `seq` of the keys
            mask = torch.ones(seq, n_keys, dtype=torch.bool, device=q.device).tril(n_keys - seq)
        mask = torch.broadcast_to(mask, (batch, heads, seq, n_keys)).reshape(batch, 1, heads * seq, n_keys)
        out = F.scaled_dot_product_attention(q.reshape(batch, 1, heads * seq, -1), keys, latents, attn_mask=mask,
                                             scale=self.scale)  # (batch, 1, heads * seq, rank)
        return torch.einsum("bhsr,hvr->bhsv", out.view(batch, heads, seq, self.rank), w_uv)  # (batch, heads, seq, value)
