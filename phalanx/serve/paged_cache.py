"""The paged KV cache that attention reads and writes during a serving step.

Per layer, keys and values live in one pool of `num_blocks * block_size` slots,
(slots, kv_heads, channels); slot `block * block_size + offset` holds the position
`index * block_size + offset` of a sequence whose block table has `block` at `index`
(block ids come from `block_manager.py`). Under tensor parallelism each rank's pools hold its
own kv heads.

A step runs at most two forwards. The decodes (one token per sequence) go one sequence per
batch row, (sequences, 1); the prompt chunks are packed into one batch row, (1, tokens): no
padding, whatever their lengths. For the model this is the AttentionCache protocol of
phalanx/model/kv_cache.py, no more:
- `positions`: each token's own position in its sequence, (sequences, 1) or (1, tokens);
- `update`: writes the new tokens' keys and values into their slots, then gathers the slots
  of every position so far: per row, (sequences, kv_heads, longest, channels) with a mask of
  each row's own length; packed, (1, kv_heads, keys, channels) with a block-diagonal causal
  mask (tokens, keys): a token sees the keys of its own sequence at its position or before
  (and within the sliding window), never another sequence's;
- `advance`: nothing (the scheduler counts computed tokens).
So a sequence's attention sees exactly what it would see alone; only the order of floating
point sums in the shared matmuls depends on what runs beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkLayout:
    """One sequence's part of a step: its block table, where its new tokens start, how many."""
    block_table: list[int]
    start: int
    length: int


def kv_channels_per_position(cfg, tp: int = 1) -> int:
    """What one layer keeps per position on this rank: the keys and values of this rank's kv
    heads, or with latent attention the compressed latent and the rotated key, one pair shared
    by every head and whole on every tp rank (parallel/latent_tp.py), cached through `update`
    as (batch, 1, seq, kv_lora_rank) and (batch, 1, seq, qk_rope_head_dim)."""
    if cfg.is_latent:
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return 2 * max(1, cfg.n_kv_heads // tp) * cfg.head_dim


def bytes_per_block(block_size: int, n_layers: int, channels: int, element_size: int) -> int:
    """One block over every layer, `channels` per position and layer (`kv_channels_per_position`)."""
    return n_layers * channels * block_size * element_size


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu"):
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (slots, kv_heads, channels)
        self.values: dict[int, torch.Tensor] = {}
        self._tokens = 0

    def prepare(self, chunks: list[ChunkLayout]) -> None:
        """Index the chunks of one forward: where each new token is written, which slots every
        sequence reads, and who sees whom. One-token chunks (decodes) go one sequence per
        batch row, (sequences, 1): each row's query sees only its own keys, padded to the
        longest; other chunks are packed into one row, (1, tokens), with the block-diagonal
        mask (a prompt chunk's queries see mostly their own sequence's keys anyway)."""
        size = self.block_size
        self._rows = all(chunk.length == 1 for chunk in chunks)
        write, read, query_pos, query_seq, key_pos, key_seq = [], [], [], [], [], []
        for index, chunk in enumerate(chunks):
            end = chunk.start + chunk.length
            slots = [chunk.block_table[p // size] * size + p % size for p in range(end)]
            write += slots[chunk.start:]
            read.append(slots)
            query_pos += range(chunk.start, end)
            query_seq += [index] * chunk.length
            key_pos += range(end)
            key_seq += [index] * end

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        self._write, self._query_pos = tensor(write), tensor(query_pos)  # (tokens,)
        self._masks: dict[int, torch.Tensor] = {}
        self._tokens = len(write)
        if self._rows:
            longest = max(len(slots) for slots in read)
            # Padding reads slot 0, masked out.
            self._read = tensor([slots + [0] * (longest - len(slots)) for slots in read])  # (sequences, longest)
            self._key_pos = torch.arange(longest, device=self.device)[None, :].expand(len(read), -1)
            self._same_seq = self._key_pos < tensor([len(slots) for slots in read])[:, None]  # (sequences, longest)
        else:
            self._read = tensor([slot for slots in read for slot in slots])  # (keys,)
            self._key_pos = tensor(key_pos)
            self._same_seq = tensor(query_seq)[:, None] == tensor(key_seq)[None, :]  # (tokens, keys)

    def batch_shape(self) -> tuple[int, int]:
        """The (batch, seq) shape the model's tokens must have for this preparation."""
        return (self._tokens, 1) if self._rows else (1, self._tokens)

    def positions(self, seq: int, device) -> torch.Tensor:
        if (1 if self._rows else self._tokens) != seq:
            raise ValueError(f"the step was prepared for tokens of shape {self.batch_shape()}, the model fed {seq}")
        if self._rows:
            return self._query_pos.to(device)[:, None]  # (sequences, 1)
        return self._query_pos.to(device)[None]  # (1, tokens)

    def mask(self, window: int) -> torch.Tensor:
        if window not in self._masks:
            if self._rows:  # (sequences, 1, 1, keys): each row's own keys, within the window
                visible = self._same_seq
                if window:
                    visible = visible & (self._query_pos[:, None] - self._key_pos < window)
                self._masks[window] = visible[:, None, None, :]
            else:
                behind = self._query_pos[:, None] - self._key_pos[None, :]  # (tokens, keys) distance back
                visible = self._same_seq & (behind >= 0)
                if window:
                    visible &= behind < window
                self._masks[window] = visible
        return self._masks[window]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        self.write(layer, k, v)
        seen_k, seen_v = self.gather(layer)
        return seen_k, seen_v, self.mask(window)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' keys and values into their slots of the layer's pools."""
        if layer not in self.keys:
            slots = self.num_blocks * self.block_size
            self.keys[layer] = k.new_zeros((slots, k.shape[1], k.shape[3]))  # (slots, kv_heads, channels)
            self.values[layer] = v.new_zeros((slots, v.shape[1], v.shape[3]))
        keys, values = self.keys[layer], self.values[layer]
        # (tokens, kv_heads, channels) from (1, kv_heads, tokens, channels) or (tokens, kv_heads, 1, channels)
        keys[self._write] = k[:, :, 0] if self._rows else k[0].transpose(0, 1)
        values[self._write] = v[:, :, 0] if self._rows else v[0].transpose(0, 1)

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values every new token sees, from the layer's pools."""
        keys, values = self.keys[layer], self.values[layer]
        if self._rows:
            seen_k = keys[self._read].transpose(1, 2)  # (sequences, kv_heads, longest, channels)
            seen_v = values[self._read].transpose(1, 2)
        else:
            seen_k = keys[self._read].transpose(0, 1)[None]  # (1, kv_heads, keys, channels)
            seen_v = values[self._read].transpose(0, 1)[None]
        return seen_k, seen_v

    def advance(self, seq: int) -> None:
        pass
