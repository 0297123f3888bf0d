"""The paged KV cache that attention reads and writes during a serving step.

Per layer, keys and values live in one pool of `num_blocks * block_size` slots,
(slots, kv_heads, channels); slot `block * block_size + offset` holds the position
`index * block_size + offset` of a sequence whose block table has `block` at `index`
(block ids come from `block_manager.py`). Under tensor parallelism each rank's pools hold its
own kv heads.

A step packs the chunks of all its sequences into one batch row, (1, tokens): no padding,
whatever their lengths. For the model this is the AttentionCache protocol of
phalanx/model/kv_cache.py, no more:
- `positions`: each token's own position in its sequence, (1, tokens);
- `update`: writes the new tokens' keys and values into their slots, then gathers for every
  sequence of the step the slots of all its positions so far, (1, kv_heads, keys, channels),
  and a block-diagonal causal mask (tokens, keys): a token sees the keys of its own sequence
  at its position or before (and within the sliding window), never another sequence's;
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


def bytes_per_block(block_size: int, n_layers: int, kv_heads: int, head_dim: int, element_size: int) -> int:
    """Keys and values of one block over every layer (this rank's kv heads)."""
    return 2 * n_layers * kv_heads * head_dim * block_size * element_size


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu"):
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (slots, kv_heads, channels)
        self.values: dict[int, torch.Tensor] = {}
        self._tokens = 0

    def prepare(self, chunks: list[ChunkLayout]) -> None:
        """Index the step's chunks: where each new token is written, which slots every
        sequence reads, and who sees whom."""
        size = self.block_size
        write, read, query_pos, query_seq, key_pos, key_seq = [], [], [], [], [], []
        for index, chunk in enumerate(chunks):
            end = chunk.start + chunk.length
            slots = [chunk.block_table[p // size] * size + p % size for p in range(end)]
            write += slots[chunk.start:]
            read += slots
            query_pos += range(chunk.start, end)
            query_seq += [index] * chunk.length
            key_pos += range(end)
            key_seq += [index] * end

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        self._write, self._read = tensor(write), tensor(read)  # (tokens,), (keys,)
        self._query_pos, self._key_pos = tensor(query_pos), tensor(key_pos)
        self._same_seq = tensor(query_seq)[:, None] == tensor(key_seq)[None, :]  # (tokens, keys)
        self._masks: dict[int, torch.Tensor] = {}
        self._tokens = len(write)

    def positions(self, seq: int, device) -> torch.Tensor:
        if seq != self._tokens:
            raise ValueError(f"the step was prepared for {self._tokens} tokens, the model fed {seq}")
        return self._query_pos.to(device)[None]  # (1, tokens)

    def mask(self, window: int) -> torch.Tensor:
        if window not in self._masks:
            behind = self._query_pos[:, None] - self._key_pos[None, :]  # (tokens, keys) distance back
            visible = self._same_seq & (behind >= 0)
            if window:
                visible &= behind < window
            self._masks[window] = visible
        return self._masks[window]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if layer not in self.keys:
            slots = self.num_blocks * self.block_size
            self.keys[layer] = k.new_zeros((slots, k.shape[1], k.shape[3]))  # (slots, kv_heads, channels)
            self.values[layer] = v.new_zeros((slots, v.shape[1], v.shape[3]))
        keys, values = self.keys[layer], self.values[layer]
        keys[self._write] = k[0].transpose(0, 1)  # (tokens, kv_heads, channels)
        values[self._write] = v[0].transpose(0, 1)
        seen_k = keys[self._read].transpose(0, 1)[None]  # (1, kv_heads, keys, channels)
        seen_v = values[self._read].transpose(0, 1)[None]
        return seen_k, seen_v, self.mask(window)

    def advance(self, seq: int) -> None:
        pass
