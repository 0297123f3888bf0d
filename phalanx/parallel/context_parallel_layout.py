"""Context parallelism's chunk layout: which positions a cp rank holds, and which blocks of
keys each of its queries attends to, so that attention needs no (queries x keys) mask.

Each sequence is cut into 2 x cp equal chunks; rank r holds chunks r and 2cp-1-r
(`layout_rules.cp_chunks`, `data/batches.chunk_positions`). Once the keys of the whole
sequence are in position order (`position_order`), the keys that query chunk c sees under
the causal mask are two blocks: chunk c itself, where query i sees keys 0..i (the causal
kernel's own top-left alignment, queries and keys of one length), and every key before the
chunk, all of them seen (no mask at all). Under `--doc-mask` each run of one document id
inside a chunk is such a pair: its diagonal block, and the keys of its document before the
chunk. A query belongs to one query range; the blocks of one range are merged by their
log-sum-exp (context_parallel_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx import layout_rules as rules


@dataclass(frozen=True)
class KeyBlock:
    """Queries [query_start, query_end) of this rank (its local positions) against keys
    [key_start, key_end) of the whole sequence in position order; `causal`: the block is
    square and query i of it sees keys 0..i of it, else every query sees every key."""
    query_start: int
    query_end: int
    key_start: int
    key_end: int
    causal: bool


def rank_chunks(cp: int, rank: int) -> list[int]:
    """The chunk indices of a rank's queries in the order it holds them; one chunk (the whole
    sequence) without cp, where `--doc-mask` alone uses the same blocks."""
    return list(rules.cp_chunks(cp, rank)) if cp > 1 else [0]


def causal_blocks(chunks: list[int], chunk: int) -> list[KeyBlock]:
    """The blocks of a rank holding `chunks` (chunk indices, each `chunk` positions long),
    causal attention: per query chunk c, its diagonal and (c > 0) the c * chunk keys before it."""
    blocks = []
    for slot, c in enumerate(chunks):
        q0 = slot * chunk
        blocks.append(KeyBlock(q0, q0 + chunk, c * chunk, (c + 1) * chunk, True))
        if c:
            blocks.append(KeyBlock(q0, q0 + chunk, 0, c * chunk, False))
    return blocks


def document_runs(ids: torch.Tensor) -> list[int]:
    """Where each run of equal document ids starts in one sequence's `ids` (seq,), and its end:
    [0, s1, s2, ..., seq]. Packed sequences number their documents in order, so a run is a
    document; a document id that came back later would start a new document here."""
    changes = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
    return [0, *changes, ids.shape[0]]


def document_blocks(chunks: list[int], chunk: int, runs: list[int]) -> list[KeyBlock]:
    """The blocks of a rank holding `chunks` under `--doc-mask`, for one sequence whose
    documents start at `runs` (`document_runs`): per query chunk and per document in it, the
    diagonal block of the document's queries in the chunk and the keys of the document before
    the chunk."""
    blocks = []
    for slot, c in enumerate(chunks):
        first, last = c * chunk, (c + 1) * chunk
        for start, end in zip(runs[:-1], runs[1:]):
            a, b = max(start, first), min(end, last)
            if a >= b:
                continue
            q0, q1 = slot * chunk + a - first, slot * chunk + b - first
            blocks.append(KeyBlock(q0, q1, a, b, True))
            if start < a:
                blocks.append(KeyBlock(q0, q1, start, a, False))
    return blocks




def row_blocks(batch: int, documents: torch.Tensor | None, chunks: list[int],
                chunk: int) -> list[tuple[slice, dict[tuple[int, int], list[KeyBlock]]]]:
    """[(batch rows, {query range: its blocks})]: all rows at once without documents, else row by row."""
    if documents is None:
        rows = [(slice(None), causal_blocks(chunks, chunk))]
    else:
        rows = [(slice(i, i + 1), document_blocks(chunks, chunk, document_runs(documents[i]))) for i in range(batch)]
    out = []
    for row, blocks in rows:
        by_range: dict[tuple[int, int], list[KeyBlock]] = {}
        for block in blocks:
            by_range.setdefault((block.query_start, block.query_end), []).append(block)
        out.append((row, by_range))
    return out


def owner_blocks(blocks: list[KeyBlock], cp: int, chunk: int, owner: int) -> list[tuple[KeyBlock, int]]:
    """The parts of `blocks` whose keys cp rank `owner` holds (its chunks `owner` and
    2cp-1-owner), each as (the part, its keys' start among the owner's own positions: its two
    chunks one after the other). A causal block lies inside one chunk, so it is whole in one
    owner's part; an unmasked block is cut at chunk edges. What a ring step computes with the
    keys it holds (context_parallel_ring.py)."""
    parts = []
    for b in blocks:
        for slot, c in enumerate(rules.cp_chunks(cp, owner)):
            first, last = c * chunk, (c + 1) * chunk
            a, e = max(b.key_start, first), min(b.key_end, last)
            if a < e:
                parts.append((KeyBlock(b.query_start, b.query_end, a, e, b.causal), slot * chunk + a - first))
    return parts



def _chunks_by_rank(cp: int) -> list[int]:
    """The chunk at each chunk slot of a gather in rank order: 0, 2cp-1, 1, 2cp-2, ..."""
    return [c for rank in range(cp) for c in rules.cp_chunks(cp, rank)]


def _reorder(t: torch.Tensor, cp: int, order: list[int]) -> torch.Tensor:
    *lead, keys, c = t.shape
    by_chunk = t.reshape(*lead, 2 * cp, keys // (2 * cp), c)  # (..., chunk slot, position in chunk, c)
    return by_chunk[..., order, :, :].reshape(*lead, keys, c)


def position_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """(..., keys, c) gathered in rank order (rank r's chunks r and 2cp-1-r, one after the
    other) -> the same keys in position order."""
    if cp == 1:
        return gathered
    slots = _chunks_by_rank(cp)
    return _reorder(gathered, cp, sorted(range(2 * cp), key=slots.__getitem__))


def rank_order(t: torch.Tensor, cp: int) -> torch.Tensor:
    """(..., keys, c) in position order -> rank order (`position_order`'s inverse): what a
    reduce-scatter hands back rank by rank."""
    return t if cp == 1 else _reorder(t, cp, _chunks_by_rank(cp))
