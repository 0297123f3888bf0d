"""Attention over a serving step's ragged batch: each sequence's queries against exactly its
own keys, one `scaled_dot_product_attention` per sequence, no padding and no mask over other
sequences' keys.

The paged cache (`paged_cache.py`) gathers the keys of every sequence of the step into one
flat tensor, sequence after sequence, (1, kv_heads, keys, channels), and hands attention a
`RaggedAttention` in place of a mask (`AttentionCore` calls its `attend`). Padding every
decode to the longest sequence of the batch and masking the rest, as one batched call does,
computed and gathered 2-3x the keys of serve_load.py's mixed lengths, and a masked kernel
over them cost more than the model's projections of the step
(benchmarks/serve_step_profile.py). What a sequence computes here does not depend on what
else runs in the step, which is batch invariance by construction.

Latent attention's absorbed form reads the mask itself, so the cache keeps the padded, masked
tensors for it (`PagedKVCache(ragged=False)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from phalanx.model.kv_cache import attention_mask


@dataclass
class RaggedAttention:
    """One forward's sequences: per sequence where its new queries are in the batch and where
    its keys are in the flat keys. Decodes come one sequence per batch row (sequences, 1);
    prompt chunks packed into one row (1, tokens)."""
    rows: bool
    key_offsets: list[int]
    """Where each sequence's keys start in the flat keys."""
    key_counts: list[int]
    """How many keys it has: its positions so far, the new ones included."""
    query_offsets: list[int]
    """Where its new tokens start in the packed row (rows: its row)."""
    query_counts: list[int]
    window: int = 0
    """A sliding window (0: none): a query sees itself and the window - 1 positions before."""
    _masks: list = field(default_factory=list)

    def with_window(self, window: int) -> "RaggedAttention":
        return RaggedAttention(self.rows, self.key_offsets, self.key_counts, self.query_offsets, self.query_counts,
                               window)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """q (sequences, heads, 1, head_dim) or (1, heads, tokens, head_dim), k and v the flat
        keys (1, kv_heads, keys, channels) -> (q's batch, heads, q's seq, channels)."""
        if self.rows:
            return self._decodes(q, k, v, scale)
        if not self._masks:  # which keys each chunk's queries see: the same in every layer
            self._masks = [attention_mask(queries, keys, self.window, q.device)
                           for queries, keys in zip(self.query_counts, self.key_counts)]
        out = q.new_empty((*q.shape[:3], v.shape[-1]))  # (1, heads, tokens, channels)
        gqa = k.shape[1] != q.shape[1]
        for start, count, key_start, keys, mask in zip(self.query_offsets, self.query_counts, self.key_offsets,
                                                       self.key_counts, self._masks):
            out[:, :, start:start + count] = F.scaled_dot_product_attention(
                q[:, :, start:start + count], k[:, :, key_start:key_start + keys], v[:, :, key_start:key_start + keys],
                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
        return out

    def _decodes(self, q, k, v, scale) -> torch.Tensor:
        """One query per sequence, which sees all its keys (within the window): no mask. The
        query heads that share a kv head are folded into that head's query rows,
        (1, kv_heads, heads / kv_heads, head_dim), the same products as grouped-query
        attention without a kernel that repeats or strides over k and v."""
        sequences, heads, _, dim = q.shape
        kv_heads = k.shape[1]
        folded = q.reshape(sequences, kv_heads, heads // kv_heads, dim)  # (sequences, kv_heads, group, head_dim)
        out = q.new_empty((sequences, kv_heads, heads // kv_heads, v.shape[-1]))
        for row, (key_start, keys) in enumerate(zip(self.key_offsets, self.key_counts)):
            first = key_start + max(0, keys - self.window) if self.window else key_start
            out[row] = F.scaled_dot_product_attention(folded[row:row + 1], k[:, :, first:key_start + keys],
                                                      v[:, :, first:key_start + keys], scale=scale)[0]
        return out.view(sequences, heads, 1, -1)  # (sequences, heads, 1, channels)
