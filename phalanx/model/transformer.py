"""A Llama-style decoder written for one device.

Nothing here knows about meshes or ranks. Parallelism is applied from outside
(`phalanx.parallel`): tensor parallelism swaps parameters for DTensors, pipeline stages
delete layers (the forward skips any part that is None or missing), FSDP wraps blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.model.attention_core import AttentionCore
from phalanx.model.config import ModelConfig
from phalanx.model.feed_forward import FeedForward
from phalanx.model.kv_cache import AttentionCache, KVCache, attention_mask
from phalanx.model.latent_attention import LatentAttention
from phalanx.model.moe import MoE
from phalanx.model.rms_norm import RMSNorm
from phalanx.model.rotary import apply_rotary, rotary_tables

__all__ = ["Attention", "AttentionCore", "Block", "FeedForward", "KVCache", "Transformer"]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.core = AttentionCore()
        self.layer, self.head_dim, self.window = layer, cfg.head_dim, cfg.sliding_window
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.attention_out_bias)
        self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, heads, head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, kv_heads, head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # The rows of these positions: (seq, head_dim/2, 2), or (batch, seq, ...) from a cache
        # whose sequences stand at different positions.
        table = rope[:seq] if cache is None else rope[cache.positions(seq, x.device)]
        q, k = apply_rotary(q, table), apply_rotary(k, table)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        if cache is not None:
            k, v, mask = cache.update(self.layer, k, v, self.window)  # (batch, kv_heads, keys, head_dim)
        else:
            mask = attention_mask(seq, seq, self.window, x.device)
        out = self.core(q, k, v, mask)  # (batch, heads, seq, head_dim)
        out = out.transpose(1, 2).reshape(batch, seq, -1)  # (batch, seq, heads * head_dim)
        return self.wo(out)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = (LatentAttention if cfg.is_latent else Attention)(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            self.feed_forward: nn.Module = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, gated=cfg.mlp == "swiglu")

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        # Two arguments when there is no cache: sequence parallelism's input hook expects two.
        x = x + (self.attention(self.attention_norm(x), rope) if cache is None else self.attention(self.attention_norm(x), rope, cache))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab).

    Layers live in a ModuleDict keyed by their index, so that a pipeline stage that deletes
    layers keeps the names (and so the checkpoints and initial weights) of the rest.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        # Not persistent: it is recomputed on materialization and never checkpointed.
        self.register_buffer("rope", rotary_tables(cfg), persistent=False)

    def tie_weights(self) -> None:
        """With tie_embeddings, make the output projection use the embedding's weight (again
        after tensor parallelism replaced both with DTensors of the same placement)."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, cache: AttentionCache | None = None, last_only: bool = False,
                read_at: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab). With a `cache` (kv_cache.py), the
        tokens follow the positions it holds, and their keys and values are added to it. `last_only`: the
        logits of the last position only (batch, 1, vocab), all generation reads of a prefill.
        `read_at`: the logits of these positions only (batch, len(read_at), vocab): a serving step
        packs several sequences into one row and reads the last position of each."""
        h = self.trunk(tokens, cache)
        if last_only:
            h = h[:, -1:]  # (batch, 1, dim)
        elif read_at is not None:
            h = h[:, read_at]  # (batch, len(read_at), dim)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def trunk(self, tokens: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        """tokens (batch, seq) -> the last layer's output (batch, seq, dim), before the final
        norm: what `forward` projects, and (normed) what a serving engine's multi-token-prediction
        draft reads at every position (multi_token_prediction.py)."""
        # A pipeline stage without the embedding receives hidden states instead of ids.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope, cache) if cache is not None else layer(h, self.rope)
        if cache is not None:
            cache.advance(tokens.shape[1])
        return h

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty` from the meta device)."""
        self.rope = rotary_tables(self.cfg, device=self.rope.device)
