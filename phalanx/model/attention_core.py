"""The scores part of attention, softmax(q k^T * scale) v, as a module without weights.

A module of its own so that `recompute=selective` (parallel/recompute.py) can recompute just
this, as Korthikanti et al.'s selective recomputation does; every attention variant calls it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AttentionCore(nn.Module):
    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale
        """None: 1 / sqrt(head_dim), scaled_dot_product_attention's default."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q (batch, heads, seq, head_dim), k and v (batch, kv_heads, keys, channels) -> (batch, heads, seq, channels).
        Grouped-query attention without repeating k and v per query head (nor saving them
        repeated for backward): each kv head serves heads / kv_heads query heads. `mask` may
        also be a serving step's ragged batch (`phalanx.serve.paged_attention`, never in
        training or generation), which attends per sequence itself."""
        if mask is not None and not isinstance(mask, torch.Tensor):
            return mask.attend(q, k, v, self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
