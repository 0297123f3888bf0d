"""A Llama-style decoder written for one device.

Nothing here knows about meshes or ranks. Parallelism is applied from outside
(`phalanx.parallel`): tensor parallelism swaps parameters for DTensors, pipeline stages
delete layers (the forward skips any part that is None or missing), FSDP wraps blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.model.config import ModelConfig
from phalanx.model.moe import MoE


def rotary_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Angle per position step of each channel pair (head_dim // 2,), with Llama 3.1's scaling:
    wavelengths longer than the original context are stretched by `rope_factor`, shorter than
    original / high_freq_factor kept, and the band between blended smoothly."""
    head_dim = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if cfg.rope_type != "llama3":
        return inv_freq
    original = cfg.rope_original_max_seq_len
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / cfg.rope_low_freq_factor, inv_freq / cfg.rope_factor, inv_freq)
    smooth = (original / wavelength - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    blended = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = (wavelength >= original / cfg.rope_high_freq_factor) & (wavelength <= original / cfg.rope_low_freq_factor)
    return torch.where(medium, blended, scaled)


def rotary_tables(cfg: ModelConfig, device=None) -> torch.Tensor:
    """cos/sin tables for rotary embeddings: (max_seq_len, head_dim // 2, 2)."""
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), rotary_frequencies(cfg, device))
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x (batch, seq, heads, head_dim) by position.

    The "half" layout of Hugging Face checkpoints, so their q/k weights load unpermuted.
    `table` holds the rows of x's positions: (seq, head_dim/2, 2)."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)  # each (batch, seq, heads, head_dim/2)
    cos = table[None, :, None, :, 0]  # (1, seq, 1, head_dim/2)
    sin = table[None, :, None, :, 1]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).type_as(x)


def attention_mask(q_len: int, k_len: int, window: int, device) -> torch.Tensor | None:
    """Which keys each query may see (q_len, k_len) bool, or None for plain causal attention.

    The queries are the last q_len of the k_len positions (a KV cache holds the earlier ones);
    with a sliding window, a query sees itself and the window - 1 positions before it."""
    if q_len == k_len and not (window and window < k_len):
        return None
    query = torch.arange(k_len - q_len, k_len, device=device)[:, None]  # absolute positions
    key = torch.arange(k_len, device=device)[None, :]
    visible = key <= query
    if window:
        visible &= query - key < window
    return visible


class KVCache:
    """Keys and values of every position seen so far, per layer, for generation.

    Tensors are allocated on first use with the shape the layer produces (under tensor
    parallelism, this rank's heads), `max_len` positions long."""

    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (batch, kv_heads, new, head_dim) after the cached positions; return all."""
        new = k.shape[2]
        if self.length + new > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions cannot take {self.length} + {new}")
        if layer not in self.keys:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys[layer] = k.new_zeros(shape)
            self.values[layer] = v.new_zeros(shape)
        end = self.length + new
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer, self.head_dim, self.window = layer, cfg.head_dim, cfg.sliding_window
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.attention_out_bias)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        start = cache.length if cache is not None else 0
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, heads, head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, kv_heads, head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        table = rope[start:start + seq]  # (seq, head_dim/2, 2): the rows of these positions
        q, k = apply_rotary(q, table), apply_rotary(k, table)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        if cache is not None:
            k, v = cache.append(self.layer, k, v)  # (batch, kv_heads, start + seq, head_dim)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        mask = attention_mask(seq, k.shape[2], self.window, x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        out = out.transpose(1, 2).reshape(batch, seq, -1)  # (batch, seq, heads * head_dim)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)) or a plain GeLU MLP (w2(gelu(w1 x)))."""

    def __init__(self, dim: int, hidden: int, gated: bool = True):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg, layer)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            self.feed_forward: nn.Module = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, gated=cfg.mlp == "swiglu")

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
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
        self.norm: nn.Module | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        # Not persistent: it is recomputed on materialization and never checkpointed.
        self.register_buffer("rope", rotary_tables(cfg), persistent=False)

    def tie_weights(self) -> None:
        """With tie_embeddings, make the output projection use the embedding's weight (again
        after tensor parallelism replaced both with DTensors of the same placement)."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab). With a `cache`, the tokens follow
        the positions it holds, and their keys and values are added to it. `last_only`: the
        logits of the last position only (batch, 1, vocab), all generation reads of a prefill."""
        # A pipeline stage without the embedding receives hidden states instead of ids.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope, cache) if cache is not None else layer(h, self.rope)
        if cache is not None:
            cache.length += tokens.shape[1]
        if last_only:
            h = h[:, -1:]  # (batch, 1, dim)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty` from the meta device)."""
        self.rope = rotary_tables(self.cfg, device=self.rope.device)
