"""Vectorized verification of candidate match starts, for every pattern length at once.

A candidate start s is extended one byte per step, L = 1, 2, ..., with a polynomial hash of
text[s : s + L] (mod 2**40). At each length one binary search finds the key among the keys of
the patterns' L-byte prefixes: an entry says which pattern of length exactly L has it (a
probable match) and whether longer patterns continue from it; a candidate found nowhere dies.
So a candidate costs one step per byte it shares with some pattern, however many patterns
share its first bytes (source code's indentation makes hundreds of patterns share their first
8 bytes, which would make as many pairs to compare). Probable matches are then compared byte
for byte, 8 bytes per step: a hash collision can cost time but never give a wrong match, and
none is missed, since equal bytes always give equal keys. The multiplier is chosen so that no
two patterns of the same length share a key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.kernels.alphabet import pattern_matrix

KEY_MASK = (1 << 40) - 1  # keys < 2**40 and multipliers < 2**23: key * multiplier fits in int64
MULTIPLIERS = (1000003, 2097143, 1048571, 4194301, 524287)


@dataclass
class LengthIndex:
    multiplier: int
    keys: dict[int, torch.Tensor]  # L -> sorted distinct keys of the patterns' L-byte prefixes
    ending: dict[int, torch.Tensor]  # L -> for each key, the pattern of length L having it, else -1
    continuing: dict[int, torch.Tensor]  # L -> for each key, whether a longer pattern has it
    lengths: torch.Tensor  # (k,)
    words: torch.Tensor  # (k, w) int64: pattern bytes, 8 per word, zero-padded
    masks: torch.Tensor  # (k, w) int64: 0xff where `words` holds a pattern byte

    @property
    def longest(self) -> int:
        return int(self.lengths.max())


def _length_tables(matrix: torch.Tensor, lengths: torch.Tensor, multiplier: int):
    """Per length: (keys, ending, continuing), or None if two same-length patterns collide."""
    tables = {}
    h = torch.zeros(matrix.shape[0], dtype=torch.int64)
    for length in range(1, matrix.shape[1] + 1):
        h = (h * multiplier + matrix[:, length - 1]) & KEY_MASK
        reach = lengths >= length
        keys, slot = torch.unique(h[reach], return_inverse=True)
        ids = torch.nonzero(reach).squeeze(1)
        ends = lengths[ids] == length
        ending = torch.full((keys.numel(),), -1, dtype=torch.int64)
        ending[slot[ends]] = ids[ends]
        if int((ending >= 0).sum()) != int(ends.sum()):
            return None
        continuing = torch.zeros(keys.numel(), dtype=torch.bool)
        continuing[slot[~ends]] = True
        tables[length] = (keys, ending, continuing)
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
    return LengthIndex(multiplier, on(0), on(1), on(2), lengths.to(device), words.to(device), masks.to(device))


def compare_words(text: torch.Tensor, starts: torch.Tensor, pats: torch.Tensor, index: LengthIndex):
    """Keep the (start, pattern) pairs whose pattern's bytes are at `start`, 8 bytes per step."""
    inside = starts + index.lengths[pats] <= text.numel()
    starts, pats = starts[inside], pats[inside]
    padded = torch.cat([text, text.new_zeros(8 * index.words.shape[1])])
    for w in range(index.words.shape[1]):
        window = padded.unfold(0, 8, 1)[starts + 8 * w].contiguous().view(torch.int64).squeeze(1)  # (pairs,)
        same = (window & index.masks[pats, w]) == index.words[pats, w]
        starts, pats = starts[same], pats[same]
    return starts, pats


def verify(index: LengthIndex, text: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (start, pattern) with the pattern at that start, for candidate `starts` of `text`."""
    padded = torch.cat([text, text.new_zeros(index.longest)]).long()  # zeros past the end: checked at the end
    h = torch.zeros_like(starts)
    found_starts, found_patterns = [], []
    for length in range(1, index.longest + 1):
        h = (h * index.multiplier + padded[starts + length - 1]) & KEY_MASK
        keys = index.keys[length]
        at = torch.searchsorted(keys, h).clamp_(max=keys.numel() - 1)
        known = keys[at] == h
        pattern = torch.where(known, index.ending[length][at], -1)
        hit = pattern >= 0
        found_starts.append(starts[hit])
        found_patterns.append(pattern[hit])
        alive = known & index.continuing[length][at]
        starts, h = starts[alive], h[alive]
        if starts.numel() == 0:
            break
    return compare_words(text, torch.cat(found_starts), torch.cat(found_patterns), index)
