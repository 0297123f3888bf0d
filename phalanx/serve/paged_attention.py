"""Attention over a serving step's ragged batch: each sequence's queries against its own keys
only, never a mask over other sequences' keys.

The paged cache (`paged_cache.py`) hands attention a `RaggedAttention` in place of a mask
(`AttentionCore` calls its `attend`). Prompt chunks: the cache gathers the keys of the step's
sequences into one flat tensor, (1, kv_heads, keys, channels), and a chunk's queries attend in
one call over its sequence's keys. Decodes: the cache hands over the layer's whole pool as
views, (pool slots, kv_heads, channels), and decodes of nearly equal length share a call over
their slots, padded to the longest of them (`PADDING_KEYS`) and masked: on the CPU read from
the pool where the keys lie (`decode_attention.py`), else gathered, then the flash kernel.
Padding every decode to the longest sequence of the batch, as one batched call does, gathered
and scored 2-3x the keys of serve_load.py's mixed lengths, and cost more than the model's
projections of the step (benchmarks/serve_step_profile.py). A sequence's result depends on what
runs beside it only through the padded, masked keys of its group (probability 0), i.e. in
float rounding.

Latent attention's absorbed form reads the mask itself, so the cache keeps the padded, masked
tensors for it (`PagedKVCache(ragged=False)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from phalanx.model.kv_cache import attention_mask
from phalanx.serve import decode_attention


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
    slots: torch.Tensor
    """(n, longest): each one's pool slots, position by position, padded with slot 0."""

    @property
    def longest(self) -> int:
        return max(self.counts)


def decode_groups(counts: list[int], slots: torch.Tensor, device) -> list[DecodeGroup]:
    """The decodes grouped by key count: longest first, a new group when a row is more than
    PADDING_KEYS shorter than its group's longest. `slots` (sequences, positions): each row's
    pool slots."""
    order = sorted(range(len(counts)), key=lambda row: -counts[row])
    members: list[list[int]] = []
    for row in order:
        if members and counts[members[-1][0]] - counts[row] <= PADDING_KEYS:
            members[-1].append(row)
        else:
            members.append([row])
    groups = []
    for rows in members:
        index = torch.tensor(rows, device=device)
        groups.append(DecodeGroup(index, [counts[row] for row in rows], slots[index, :counts[rows[0]]]))
    return groups


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
    window: int = 0
    """A sliding window (0: none): a query sees itself and the window - 1 positions before."""
    _masks: list = field(default_factory=list)

    def with_window(self, window: int) -> "RaggedAttention":
        return RaggedAttention(self.rows, self.key_offsets, self.key_counts, self.query_offsets, self.query_counts,
                               self.groups, window)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Packed chunks: q (1, heads, tokens, head_dim), k and v the flat keys
        (1, kv_heads, keys, channels). Decodes: q (sequences, heads, 1, head_dim), k and v the
        layer's pools (pool slots, kv_heads, channels). -> (q's batch, heads, q's seq, channels)."""
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

    def _decodes(self, q, k_pool, v_pool, scale) -> torch.Tensor:
        """One query per sequence, which sees all its keys (within the window). The query
        heads that share a kv head are folded into that head's query rows,
        (sequences, kv_heads, heads / kv_heads, head_dim): the same products as grouped-query
        attention, without a kernel that repeats k and v per query head."""
        sequences, heads, _, dim = q.shape
        kv_heads = k_pool.shape[1]
        folded = q.reshape(sequences, kv_heads, heads // kv_heads, dim)  # (sequences, kv_heads, group, head_dim)
        out = q.new_empty((sequences, kv_heads, heads // kv_heads, v_pool.shape[-1]))
        if not self._masks:
            self._masks = [self._decode_mask(group, q.device) for group in self.groups]
        scale = dim ** -0.5 if scale is None else scale
        from_pool = decode_attention.enabled(q.device)
        for group, (visible, everything) in zip(self.groups, self._masks):
            queries = folded.index_select(0, group.rows)
            found = None
            if from_pool:
                found = decode_attention.compiled_attend(queries, k_pool, v_pool, group.slots, visible, scale)
            if found is None:  # gathered: (n, kv_heads, longest, channels)
                keys, values = k_pool[group.slots].transpose(1, 2), v_pool[group.slots].transpose(1, 2)
                mask = None if everything else visible[:, None, None, :]
                found = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
            out.index_copy_(0, group.rows, found)
        return out.view(sequences, heads, 1, -1)  # (sequences, heads, 1, channels)

    def _decode_mask(self, group: DecodeGroup, device) -> tuple[torch.Tensor, bool]:
        """(n, longest): each row's own keys, within the window; and whether that is all of them."""
        key = torch.arange(group.longest, device=device)[None, :]
        counts = torch.tensor(group.counts, device=device)[:, None]
        visible = key < counts
        if self.window:
            visible &= key >= counts - self.window
        return visible, bool(visible.all())
