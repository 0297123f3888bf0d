"""What attention needs from a cache of earlier positions, and the contiguous cache of
`phalanx generate`.

Attention knows nothing of how a cache is laid out or scheduled. It asks a cache two things:
- `positions(seq, device)`: the absolute positions of the `seq` new tokens, (seq,) when every
  sequence of the batch is at the same positions, else (batch, seq);
- `update(layer, k, v, window)`: store the new tokens' two per-position tensors (keys and
  values, or any pair a variant caches, each (batch, kv_heads, seq, channels)) and return
  what the new queries see: both tensors over every visible key (batch, kv_heads, keys, channels)
  and a boolean mask broadcastable to (batch, heads, seq, keys), or None when query i sees
  keys 0..i exactly (plain causal attention, `is_causal=True`), or (a serving engine's paged
  cache, or context parallelism's view of the sequence; only for attention through
  `AttentionCore`) an object whose `attend(q, k, v, scale)` computes the attention itself, from
  the two tensors the same `update` returned (which it may then define otherwise: cp hands back
  the rank's own keys and values and gathers the rest in `attend`).
The model calls `advance(seq)` once every layer took the new tokens. A paged cache of a
serving engine answers the same three calls with per-sequence positions and block tables.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionCache(Protocol):
    def positions(self, seq: int, device) -> torch.Tensor: ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...

    def advance(self, seq: int) -> None: ...


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
    """Keys and values of every position seen so far, per layer, for a batch of sequences
    that share their length (generation).

    Tensors are allocated on first use with the shape the layer produces (under tensor
    parallelism, this rank's heads), `max_len` positions long."""

    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def positions(self, seq: int, device) -> torch.Tensor:
        return torch.arange(self.length, self.length + seq, device=device)  # (seq,)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (batch, kv_heads, new, channels) after the cached positions; return all."""
        new = k.shape[2]
        if self.length + new > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions cannot take {self.length} + {new}")
        if layer not in self.keys:
            self.keys[layer] = k.new_zeros((*k.shape[:2], self.max_len, *k.shape[3:]))
            self.values[layer] = v.new_zeros((*v.shape[:2], self.max_len, *v.shape[3:]))
        end = self.length + new
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        keys, values = self.append(layer, k, v)
        return keys, values, attention_mask(k.shape[2], keys.shape[2], window, k.device)

    def advance(self, seq: int) -> None:
        self.length += seq
