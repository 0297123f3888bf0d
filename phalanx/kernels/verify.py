"""Vectorized verification of candidate match starts, for every pattern length at once.

A candidate start s gets a polynomial hash of text[s : s + L] (mod 2**40) for L = m (the
shortest pattern), m + 1, ...: the first m bytes are hashed with plain gathers (every pattern
is at least m long, so nothing can end or die before), then each further length costs one
binary search among the keys of the patterns' L-byte prefixes. An entry says which pattern of
length exactly L has that key (a probable match) and whether longer patterns continue from it;
a candidate found nowhere dies. So a candidate costs one step per byte it shares with some
pattern, however many patterns share its first bytes (source code's indentation makes hundreds
of patterns share their first 8 bytes, which would make as many pairs to compare). Probable
matches are then compared 8 bytes at a time: a hash collision can cost time but never give a
wrong match, and none is missed, since equal bytes always give equal keys. The multiplier is
chosen so that no two patterns of the same length share a key.

Dead lanes are dropped only when a quarter of them have died (a masked lane costs less than
compacting every array every step), and every index is a gather (`index_select`), never a
boolean mask: both were most of the time in profiles.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from phalanx.kernels.alphabet import pattern_matrix

KEY_MASK = (1 << 40) - 1  # keys < 2**40 and multipliers < 2**23: key * multiplier fits in int64
MULTIPLIERS = (1000003, 2097143, 1048571, 4194301, 524287)
COMPACT_BELOW = 0.75  # drop dead lanes once fewer than this share of them are alive


@dataclass
class LengthIndex:
    multiplier: int
    keys: dict[int, torch.Tensor]  # L -> sorted distinct keys of the patterns' L-byte prefixes (L >= shortest)
    info: dict[int, torch.Tensor]  # L -> per key: 2 * (1 + pattern of length L having it, or 0) + (a longer one does)
    lengths: torch.Tensor  # (k,) int64
    words: torch.Tensor  # (k, w) int64: pattern bytes, 8 per word, zero-padded
    masks: torch.Tensor  # (k, w) int64: 0xff where `words` holds a pattern byte

    @property
    def shortest(self) -> int:
        return min(self.keys)

    @property
    def longest(self) -> int:
        return max(self.keys)


def _length_tables(matrix: torch.Tensor, lengths: torch.Tensor, multiplier: int):
    """Per length from the shortest pattern's: (keys, info), or None if two same-length
    patterns collide."""
    tables = {}
    shortest = int(lengths.min())
    h = torch.zeros(matrix.shape[0], dtype=torch.int64)
    for length in range(1, matrix.shape[1] + 1):
        h = (h * multiplier + matrix[:, length - 1]) & KEY_MASK
        if length < shortest:
            continue
        reach = lengths >= length
        keys, slot = torch.unique(h[reach], return_inverse=True)
        ids = torch.nonzero(reach).squeeze(1)
        ends = lengths[ids] == length
        ending = torch.zeros(keys.numel(), dtype=torch.int64)
        ending[slot[ends]] = ids[ends] + 1
        if int((ending > 0).sum()) != int(ends.sum()):
            return None
        continuing = torch.zeros(keys.numel(), dtype=torch.int64)
        continuing[slot[~ends]] = 1
        tables[length] = (keys, 2 * ending + continuing)
    return tables


def build_index(patterns: list[bytes], device: torch.device | str = "cpu") -> LengthIndex:
    lengths = torch.tensor([len(p) for p in patterns], dtype=torch.int64)
    longest = int(lengths.max())
    matrix = pattern_matrix(patterns, longest).long()  # (k, longest)
    for multiplier in MULTIPLIERS:
        tables = _length_tables(matrix, lengths, multiplier)
        if tables is not None:
            break
    else:
        raise RuntimeError("every hash multiplier gave two same-length patterns the same key")
    width = 8 * -(-longest // 8)
    words = pattern_matrix(patterns, width).view(torch.int64)  # (k, width / 8), native byte order as the text's
    masks = ((torch.arange(width) < lengths[:, None]).to(torch.uint8) * 255).view(torch.int64)
    on = lambda i: {length: t[i].to(device) for length, t in tables.items()}
    return LengthIndex(multiplier, on(0), on(1), lengths.to(device), words.to(device), masks.to(device))


def text_words(text: torch.Tensor, starts: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The `count` 8-byte words (int64, native byte order) at each start, read from aligned
    words of the text: no per-position copy of the text. Bytes past the end read as 0."""
    assert sys.byteorder == "little", "text_words joins aligned words in little-endian order"
    n = text.numel()
    aligned = torch.cat([text, text.new_zeros(8 * (count + 2) - n % 8)]).view(torch.int64)
    word_at = starts >> 3
    right = (starts & 7) * 8  # bits to drop from the first aligned word
    keep_low = (torch.ones_like(right) << (63 - right)) * 2 - 1  # (1 << (64 - right)) - 1, all ones at right 0
    left = 63 - right  # shifting by 64 - right in two steps: by 64 gives 0 at right 0
    low = aligned.index_select(0, word_at)
    out = []
    for w in range(count):
        high = aligned.index_select(0, word_at + w + 1)
        out.append(((low >> right) & keep_low) | ((high << left) << 1))
        low = high
    return out


def compare_words(text: torch.Tensor, starts: torch.Tensor, pats: torch.Tensor, index: LengthIndex):
    """Keep the (start, pattern) pairs whose pattern's bytes are at `start`, 8 bytes per step."""
    same = starts + index.lengths.index_select(0, pats) <= text.numel()
    words = index.words.index_select(0, pats)
    masks = index.masks.index_select(0, pats)
    for w, window in enumerate(text_words(text, starts, index.words.shape[1])):
        same &= (window & masks[:, w]) == words[:, w]
    keep = torch.nonzero(same).squeeze(1)
    return starts.index_select(0, keep), pats.index_select(0, keep)


def verify(index: LengthIndex, text: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (start, pattern) with the pattern at that start, for candidate `starts` (int64) of
    `text` (uint8)."""
    padded = torch.cat([text, text.new_zeros(index.longest)])  # zeros past the end: checked at the end
    h = torch.zeros_like(starts)
    for offset in range(index.shortest - 1):
        h = (h * index.multiplier + padded.index_select(0, starts + offset).long()) & KEY_MASK
    live = None  # bool mask of lanes still alive, None when all are
    found_starts, found_patterns = [], []
    for length in range(index.shortest, index.longest + 1):
        h = (h * index.multiplier + padded.index_select(0, starts + length - 1).long()) & KEY_MASK
        keys = index.keys[length]
        at = torch.searchsorted(keys, h).clamp_(max=keys.numel() - 1)
        known = keys.index_select(0, at) == h
        if live is not None:
            known &= live
        info = torch.where(known, index.info[length].index_select(0, at), 0)
        hit = torch.nonzero(info > 1).squeeze(1)
        if hit.numel():
            found_starts.append(starts.index_select(0, hit))
            found_patterns.append((info.index_select(0, hit) >> 1) - 1)
        if length == index.longest:
            break
        live = (info & 1).bool()
        alive = int(live.sum())
        if alive == 0:
            break
        if alive < COMPACT_BELOW * starts.numel():
            keep = torch.nonzero(live).squeeze(1)
            starts, h, live = starts.index_select(0, keep), h.index_select(0, keep), None
    if not found_starts:
        return starts.new_empty(0), starts.new_empty(0)
    return compare_words(text, torch.cat(found_starts), torch.cat(found_patterns), index)
