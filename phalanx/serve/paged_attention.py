"""Attention over a serving step's ragged batch: each sequence's queries against its own keys
only, never a mask over other sequences' keys.

The paged cache (`paged_cache.py`) gathers the keys of the step's sequences into one flat
tensor, (1, kv_heads, keys, channels), and hands attention a `RaggedAttention` in place of a
mask (`AttentionCore` calls its `attend`). On the CPU in float32 or bfloat16, decodes instead read their
keys straight from the pool, all in one call of a C kernel (`cpu_ops/decode_kernel.py`, `PoolRead`). A prompt chunk's queries attend in one call over
its sequence's keys. Decodes of nearly equal length share a call, their keys padded to the
longest of them (`PADDING_KEYS`). Padding every decode to the longest sequence of the batch,
as one batched call does, gathered and scored 2-3x the keys of serve_load.py's mixed lengths,
and cost more than the model's projections of the step (benchmarks/serve_step_profile.py).
A sequence's result depends on what runs beside it only through the padded, masked keys of
its group (probability 0), i.e. in float rounding.

Latent attention's absorbed form reads the mask itself, so the cache keeps the padded, masked
tensors for it (`PagedKVCache(ragged=False)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from phalanx.model.kv_cache import attention_mask
from phalanx.cpu_ops import decode_kernel as cpu_decode_kernel


PADDING_KEYS = 64
"""Decodes whose key counts differ by at most this share one attention call, padded to the
longest of them and masked: a call's fixed cost (~50-100 us on one CPU thread) weighs as much
as gathering and scoring a few hundred keys, so a few calls over nearly equal lengths beat both
one call per sequence and one call padded to the longest of the batch."""


@dataclass
class DecodeGroup:
    """Decodes of nearly the same length, attended in one call."""
    rows: torch.Tensor
    """(n,) their batch rows."""
    counts: list[int]
    """Each one's keys (its positions so far, the new one included)."""
    key_offset: int
    """Where their keys start in the flat keys: each row's padded to `longest`, row after row."""

    @property
    def longest(self) -> int:
        return max(self.counts)


def decode_groups(counts: list[int], device) -> list[DecodeGroup]:
    """The decodes grouped by key count: longest first, a new group when a row is more than
    PADDING_KEYS shorter than its group's longest."""
    order = sorted(range(len(counts)), key=lambda row: -counts[row])
    members: list[list[int]] = []
    for row in order:
        if members and counts[members[-1][0]] - counts[row] <= PADDING_KEYS:
            members[-1].append(row)
        else:
            members.append([row])
    groups, offset = [], 0
    for rows in members:
        groups.append(DecodeGroup(torch.tensor(rows, device=device), [counts[row] for row in rows], offset))
        offset += len(rows) * counts[rows[0]]
    return groups


@dataclass
class PoolRead:
    """Decodes read straight from the layer's pool by the CPU kernel: then attention gets the
    pools as views, (pool slots, kv_heads, channels), instead of gathered keys."""
    slots: torch.Tensor
    """(sequences, positions): each one's pool slots, position by position."""
    ends: torch.Tensor
    """(sequences,): its key count (its positions so far, the new one included)."""


@dataclass
class RaggedAttention:
    """One forward's sequences: prompt chunks packed into one row (1, tokens), each chunk's
    queries and keys by offset and count; or decodes, one sequence per batch row
    (sequences, 1), in `groups` of nearly equal length."""
    rows: bool
    key_offsets: list[int]
    """Where each sequence's keys start in the flat keys (packed chunks)."""
    key_counts: list[int]
    """How many keys it has: its positions so far, the new ones included."""
    query_offsets: list[int]
    """Where its new tokens start in the packed row."""
    query_counts: list[int]
    groups: list[DecodeGroup] = field(default_factory=list)
    pool_read: PoolRead | None = None
    window: int = 0
    """A sliding window (0: none): a query sees itself and the window - 1 positions before."""
    _masks: list = field(default_factory=list)
    _kernel_rows: tuple | None = None
    """With `pool_read`: the kernel's slots, first and end keys, and most keys, for every layer."""

    def with_window(self, window: int) -> "RaggedAttention":
        return RaggedAttention(self.rows, self.key_offsets, self.key_counts, self.query_offsets, self.query_counts,
                               self.groups, self.pool_read, window)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """q (sequences, heads, 1, head_dim) or (1, heads, tokens, head_dim), k and v the flat
        keys (1, kv_heads, keys, channels), or the pools (pool slots, kv_heads, channels) with
        `pool_read` -> (q's batch, heads, q's seq, channels)."""
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
        """One query per sequence, which sees all its keys (within the window). The query
        heads that share a kv head are folded into that head's query rows,
        (sequences, kv_heads, heads / kv_heads, head_dim): the same products as grouped-query
        attention, without a kernel that repeats k and v per query head."""
        sequences, heads, _, dim = q.shape
        kv_heads = k.shape[1]
        folded = q.reshape(sequences, kv_heads, heads // kv_heads, dim)  # (sequences, kv_heads, group, head_dim)
        if self.pool_read is not None:
            if self._kernel_rows is None:  # the same in every layer: worked out once a step
                ends = self.pool_read.ends.contiguous()
                first = (ends - self.window).clamp(min=0) if self.window else torch.zeros_like(ends)
                self._kernel_rows = (self.pool_read.slots.contiguous(), first, ends, int((ends - first).max()))
            out = cpu_decode_kernel.attend(folded, k, v, *self._kernel_rows, dim ** -0.5 if scale is None else scale)
            return out.view(sequences, heads, 1, -1)  # (sequences, heads, 1, channels)
        out = q.new_empty((sequences, kv_heads, heads // kv_heads, v.shape[-1]))
        if not self._masks:
            self._masks = [self._decode_mask(group, q.device) for group in self.groups]
        for group, mask in zip(self.groups, self._masks):
            n, longest = len(group.counts), group.longest
            span = slice(group.key_offset, group.key_offset + n * longest)
            keys = k[0, :, span].view(kv_heads, n, longest, -1).transpose(0, 1)  # (n, kv_heads, longest, channels)
            values = v[0, :, span].view(kv_heads, n, longest, -1).transpose(0, 1)
            out.index_copy_(0, group.rows, F.scaled_dot_product_attention(folded.index_select(0, group.rows), keys,
                                                                          values, attn_mask=mask, scale=scale))
        return out.view(sequences, heads, 1, -1)  # (sequences, heads, 1, channels)

    def _decode_mask(self, group: DecodeGroup, device) -> torch.Tensor | None:
        """(n, 1, 1, longest): each row's own keys, within the window; None when all are seen."""
        key = torch.arange(group.longest, device=device)[None, :]
        counts = torch.tensor(group.counts, device=device)[:, None]
        visible = key < counts
        if self.window:
            visible &= key >= counts - self.window
        return None if bool(visible.all()) else visible[:, None, None, :]
