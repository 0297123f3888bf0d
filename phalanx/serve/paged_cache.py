"""The paged KV cache that attention reads and writes during a serving step.

Per layer, keys and values live in one pool of `num_blocks * block_size` slots,
(slots, kv_heads * key channels + kv_heads * value channels): a slot's keys and values are one
contiguous row, so that reading a step's slots is one gather of whole rows per layer (the
attention kernels take the strided views of keys and values it gives).
`benchmarks/serve_step_profile.py --moe --threads 0` (2 threads): the gather of a step of 32
decodes took 2.04 ms, where gathering keys and values each from (kv_heads, slots, channels)
pools took 3.07 ms (0.18 s against 0.32 s over the run), the run 889.7 output tok/s against
769.3. Slot `block * block_size + offset` holds the position
`index * block_size + offset` of a sequence whose block table has `block` at `index`
(block ids come from `block_manager.py`). Under tensor parallelism each rank's pools hold its
own kv heads.

A step runs at most two forwards. The decodes (one token per sequence) go one sequence per
batch row, (sequences, 1); the prompt chunks are packed into one batch row, (1, tokens): no
padding, whatever their lengths. For the model this is the AttentionCache protocol of
phalanx/model/kv_cache.py, no more:
- `positions`: each token's own position in its sequence, (sequences, 1) or (1, tokens);
- `update`: writes the new tokens' keys and values into their slots, then gathers the slots
  of every position so far. Ragged (`PagedKVCache(ragged=True)`, what the engine uses for
  attention through `AttentionCore`): every sequence's keys one after another,
  (1, kv_heads, keys, channels), and in place of a mask a `paged_attention.RaggedAttention`
  that attends per sequence over exactly its own keys. Else (latent attention's absorbed
  form reads the mask): per row (sequences, kv_heads, longest, channels) with a mask of each
  row's own length; packed, (1, kv_heads, keys, channels) with a block-diagonal causal mask
  (tokens, keys). Either way a token sees the keys of its own sequence at its position or
  before (and within the sliding window), never another sequence's;
- `advance`: nothing (the scheduler counts computed tokens).
So a sequence's attention sees exactly what it would see alone; only the order of floating
point sums in the shared matmuls depends on what runs beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from phalanx.planner.kv_cache import kv_values_per_token_layer
from phalanx.serve.paged_attention import PoolRead, RaggedAttention, decode_groups


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
    as (batch, 1, seq, kv_lora_rank) and (batch, 1, seq, qk_rope_head_dim). The planner's own
    count (planner/kv_cache.py), so a plan's KV pool and the server's are the same size."""
    return kv_values_per_token_layer(cfg, tp)


def bytes_per_block(block_size: int, n_layers: int, channels: int, element_size: int) -> int:
    """One block over every layer, `channels` per position and layer (`kv_channels_per_position`)."""
    return n_layers * channels * block_size * element_size


@dataclass(frozen=True)
class PoolReadRows:
    """A decode step that reads the pool, in tensors: each sequence's new position (n, 1), the
    slot its keys go to (n,), its slots position by position (n, positions), its key count (n,)."""
    positions: torch.Tensor
    write: torch.Tensor
    slots: torch.Tensor
    ends: torch.Tensor


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu", ragged: bool = False,
                 pool_kernel: bool = False):
        """`ragged`: attention per sequence over exactly its keys (`paged_attention.py`), for
        attention that runs through `AttentionCore`; else padded keys and a mask (what latent
        attention's absorbed form reads). `pool_kernel` (with `ragged`): decodes read their
        keys straight from the pool (`cpu_ops/decode_kernel.py`: CPU, float32 or bfloat16) instead of gathered."""
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        self.ragged, self.pool_kernel = ragged, ragged and pool_kernel
        self.pools: dict[int, torch.Tensor] = {}  # layer -> (slots, key channels + value channels)
        self._shapes: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {}  # layer -> (kv_heads, channels) of k, v
        self._tokens = 0
        self._from_pool = False

    def prepare(self, chunks: list[ChunkLayout]) -> None:
        """Index the chunks of one forward: where each new token is written, which slots every
        sequence reads, and who sees whom. One-token chunks (decodes) go one sequence per
        batch row, (sequences, 1); other chunks are packed into one row, (1, tokens). Ragged:
        every sequence's slots one after another, read once per layer for all of them. Else
        for decodes each row's slots padded to the longest and masked, for packed chunks the
        block-diagonal mask (a prompt chunk's queries see mostly their own keys anyway)."""
        size = self.block_size
        self._rows = all(chunk.length == 1 for chunk in chunks)
        starts = [chunk.start for chunk in chunks]
        ends = [chunk.start + chunk.length for chunk in chunks]
        needed = [-(-end // size) for end in ends]  # blocks
        widest = max(needed)
        tables = self._tensor([chunk.block_table[:n] + [0] * (widest - n)
                               for chunk, n in zip(chunks, needed)])  # (chunks, widest); padding reads block 0
        slots = (tables[:, :, None] * size + torch.arange(size, device=self.device)).view(len(chunks), -1)
        position = torch.arange(widest * size, device=self.device).expand_as(slots)  # (chunks, widest * size)
        end_at = self._tensor(ends)[:, None]
        seen = position < end_at  # (chunks, widest * size): the positions each chunk's tokens see
        new = seen & (position >= self._tensor(starts)[:, None])
        self._write, self._query_pos = slots[new], position[new]  # (tokens,), chunk after chunk
        self._tokens = len(self._write)
        self._masks: dict[int, torch.Tensor] = {}
        self._ragged: dict[int, RaggedAttention] = {}
        self._from_pool = self.pool_kernel and self._rows
        if self._from_pool:  # attention reads the slots of the pool itself
            self._read = None
            self._batch = RaggedAttention(True, [], ends, [], [1] * len(chunks),
                                          pool_read=PoolRead(slots, self._tensor(ends)))
        elif self.ragged and self._rows:
            groups = decode_groups(ends, self.device)
            # (keys,): each group's rows padded to its longest, row after row, group after group
            self._read = torch.cat([slots[group.rows, :group.longest].reshape(-1) for group in groups])
            self._batch = RaggedAttention(True, [], ends, [], [1] * len(chunks), groups)
        elif self.ragged:
            self._read = slots[seen]  # (keys,): every chunk's slots, chunk after chunk
            lengths = [chunk.length for chunk in chunks]
            self._batch = RaggedAttention(False, _offsets(ends), ends, _offsets(lengths), lengths)
        elif self._rows:
            longest = max(ends)
            self._read = slots[:, :longest]  # (sequences, longest)
            self._key_pos = position[:, :longest]
            self._same_seq = seen[:, :longest]  # (sequences, longest)
        else:
            counts = torch.tensor([chunk.length for chunk in chunks], device=self.device)
            chunk_ids = torch.arange(len(chunks), device=self.device)
            self._read = slots[seen]  # (keys,)
            self._key_pos = position[seen]
            query_seq = chunk_ids.repeat_interleave(counts)  # (tokens,)
            key_seq = chunk_ids.repeat_interleave(end_at[:, 0])  # (keys,)
            self._same_seq = query_seq[:, None] == key_seq[None, :]  # (tokens, keys)

    def pool_read_rows(self) -> PoolReadRows:
        """The prepared decode step as tensors (`compiled_decode.py`): only for decodes that read
        the pool (`pool_kernel`)."""
        if not self._from_pool:
            raise ValueError("pool_read_rows needs a prepared decode step that reads the pool (pool_kernel)")
        read = self._batch.pool_read
        return PoolReadRows(self._query_pos[:, None], self._write, read.slots, read.ends)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

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
               window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | RaggedAttention | None]:
        self.write(layer, k, v)
        seen_k, seen_v = self.pool_views(layer) if self._from_pool else self.gather(layer)
        if self.ragged:
            if window not in self._ragged:
                self._ragged[window] = self._batch.with_window(window)
            return seen_k, seen_v, self._ragged[window]
        return seen_k, seen_v, self.mask(window)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' keys and values into their slots of the layer's pool."""
        if layer not in self.pools:
            slots = self.num_blocks * self.block_size
            self._shapes[layer] = ((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]))
            width = k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]
            self.pools[layer] = k.new_zeros((slots, width))  # zeros: padding keys read masked slots
        # (tokens, kv_heads * channels) from (tokens, kv_heads, 1, channels) or (1, kv_heads, tokens, channels)
        flat = [(t[:, :, 0] if self._rows else t[0].transpose(0, 1)).reshape(self._tokens, -1) for t in (k, v)]
        self.pools[layer].index_copy_(0, self._write, torch.cat(flat, 1))

    def pool_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values, every slot: (pool slots, kv_heads, channels) each."""
        (k_heads, k_channels), (v_heads, v_channels) = self._shapes[layer]
        pool = self.pools[layer]
        return (pool[:, :k_heads * k_channels].unflatten(-1, (k_heads, k_channels)),
                pool[:, k_heads * k_channels:].unflatten(-1, (v_heads, v_channels)))

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the new tokens see, from the layer's pool: ragged or packed
        (1, kv_heads, keys, channels), padded rows (sequences, kv_heads, longest, channels);
        strided views of one gather of whole slot rows."""
        (k_heads, k_channels), (v_heads, v_channels) = self._shapes[layer]
        rows = self.pools[layer][self._read] if self._read.dim() == 2 else self.pools[layer].index_select(0, self._read)
        keys = rows[..., :k_heads * k_channels].unflatten(-1, (k_heads, k_channels))  # (..., keys, kv_heads, channels)
        values = rows[..., k_heads * k_channels:].unflatten(-1, (v_heads, v_channels))
        if self._read.dim() == 1:  # (1, kv_heads, keys, channels)
            return keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        return keys.transpose(1, 2), values.transpose(1, 2)  # (sequences, kv_heads, longest, channels)

    def advance(self, seq: int) -> None:
        pass


def _offsets(counts: list[int]) -> list[int]:
    """Where each of consecutive runs of these lengths starts."""
    return list(accumulate(counts, initial=0))[:-1]
