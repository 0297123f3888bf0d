"""Which sequences make up each step's global batch, and which of them a rank reads.

A batch is a pure function of (seed, step): the same global batch whatever the layout, so
every layout computes the same thing, and a resumed run reads exactly what the
uninterrupted run would have.
"""

from __future__ import annotations

import numpy as np
import torch

from phalanx import layout_rules as rules
from phalanx.errors import UserError


def window_starts(n_tokens: int, seq_len: int, count: int, seed: int, step: int) -> np.ndarray:
    """`count` random window starts for `step`, each leaving room for seq_len + 1 tokens."""
    if n_tokens < seq_len + 2:
        raise UserError(f"the data has {n_tokens} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq_len - 1, size=count)


def take_windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each (len(starts), seq_len) int64."""
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    data = torch.from_numpy(rows)  # (batch, seq_len + 1)
    return data[:, :-1], data[:, 1:]


def chunk_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions of a sequence that context-parallel rank `rank` holds, its two chunks of
    the 2 x cp in order (`layout_rules.cp_chunks`): (seq_len / cp,)."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in rules.cp_chunks(cp, rank)])


def rank_rows(global_batch: int, dp_rank: int, dp_size: int, rows: tuple[int, int] | None) -> slice:
    """The rows of the global batch a dp rank reads: `rows` ([start, stop), uneven shares
    adapted to the ranks' speeds, `adapt_policy.share_rows`), else its equal slice."""
    if rows is not None:
        return slice(*rows)
    per_rank = global_batch // dp_size
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def rank_documents(
    document_starts: np.ndarray, n_tokens: int, *, seed: int, step: int, global_batch: int, seq_len: int, dp_rank: int,
    dp_size: int, rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """For `--doc-mask`: which document each input position of this dp rank's whole sequences
    (not cut for cp) belongs to, (per_rank, seq_len) int64 (`rank_batch`'s windows)."""
    starts = window_starts(n_tokens, seq_len, global_batch, seed, step)
    positions = starts[rank_rows(global_batch, dp_rank, dp_size, rows), None] + np.arange(seq_len)  # (per_rank, seq_len)
    return torch.from_numpy(np.searchsorted(document_starts, positions, side="right").astype(np.int64))


def rank_batch(
    tokens: np.ndarray, *, seed: int, step: int, global_batch: int, seq_len: int, dp_rank: int, dp_size: int,
    cp: int = 1, cp_rank: int = 0, rows: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's contiguous slice of the step's global batch (`rows` when the
    shares are uneven, `rank_rows`); with context parallelism, of each sequence only this cp
    rank's positions (`chunk_positions`)."""
    starts = window_starts(len(tokens), seq_len, global_batch, seed, step)
    inputs, targets = take_windows(tokens, starts[rank_rows(global_batch, dp_rank, dp_size, rows)], seq_len)
    if cp == 1:
        return inputs, targets
    mine = chunk_positions(seq_len, cp, cp_rank)
    return inputs[:, mine], targets[:, mine]  # each (per_rank, seq_len / cp)
