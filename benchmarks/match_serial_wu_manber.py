"""The baseline of benchmarks/match_throughput.py: Wu & Manber's algorithm (1994) as the paper
writes it, serial, one thread, in plain Python: a window of the m shortest-pattern bytes slides
over the text by SHIFT[last block]; on a shift of 0, the HASH bucket's patterns whose PREFIX
(first two bytes) agrees are compared. Every occurrence is counted, overlapping ones included.
"""

from __future__ import annotations

import math


def block_size(patterns: list[bytes]) -> int:
    """The paper's B = log_c(2 k m), rounded up, within [1, m]."""
    m = min(map(len, patterns))
    alphabet = max(2, len(set().union(*(set(p) for p in patterns))))
    return max(1, min(m, math.ceil(math.log(2 * len(patterns) * m) / math.log(alphabet))))


def count_matches(patterns: list[bytes], text: bytes) -> list[int]:
    m, block = min(map(len, patterns)), block_size(patterns)
    default = m - block + 1
    shift: dict[bytes, int] = {}
    buckets: dict[bytes, list[tuple[bytes, bytes, int]]] = {}
    for index, pattern in enumerate(patterns):
        for end in range(block, m + 1):
            key = pattern[end - block : end]
            shift[key] = min(shift.get(key, default), m - end)
        buckets.setdefault(pattern[m - block : m], []).append((pattern[:2], pattern, index))
    counts = [0] * len(patterns)
    end, n = m, len(text)  # the window is text[end - m : end]
    while end <= n:
        key = text[end - block : end]
        step = shift.get(key, default)
        if step:
            end += step
            continue
        start = end - m
        prefix = text[start : start + 2]
        for pattern_prefix, pattern, index in buckets[key]:
            if pattern_prefix == prefix and text.startswith(pattern, start):
                counts[index] += 1
        end += 1
    return counts
