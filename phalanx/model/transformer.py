"""A Llama-style decoder written for one device.

Nothing here knows about meshes or ranks. Parallelism is applied from outside
(`phalanx.parallel`): tensor parallelism swaps parameters for DTensors, pipeline stages
delete layers (the forward skips any part that is None or missing), FSDP wraps blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.model.config import ModelConfig
from phalanx.model.moe import MoE


def rotary_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """cos/sin tables for rotary embeddings: (max_seq_len, head_dim // 2, 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim) by position."""
    seq = x.shape[1]
    pairs = x.float().unflatten(-1, (-1, 2))  # (batch, seq, heads, head_dim/2, 2)
    cos = table[:seq, None, :, 0]  # (seq, 1, head_dim/2)
    sin = table[:seq, None, :, 1]
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, heads, head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, kv_heads, head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            self.feed_forward: nn.Module = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, gated=cfg.mlp == "swiglu")

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
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
        # Not persistent: it is recomputed on materialization and never checkpointed.
        self.register_buffer("rope", rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage without the embedding receives hidden states instead of ids.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty` from the meta device)."""
        cfg = self.cfg
        self.rope = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=self.rope.device)
