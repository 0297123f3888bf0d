"""The patterns' alphabet: bytes that occur in some pattern get codes 1..c, every other byte
code 0, so tables are indexed by (c + 1)-letter codes instead of 256 byte values. A text
window holding a code-0 byte cannot be part of any match.
"""

from __future__ import annotations

import torch


def byte_codes(patterns: list[bytes]) -> tuple[torch.Tensor, int]:
    """(code of each byte value, shape (256,) int64; c = letters used by the patterns)."""
    used = sorted(set().union(*(set(p) for p in patterns)))
    codes = torch.zeros(256, dtype=torch.int64)
    codes[torch.tensor(used, dtype=torch.int64)] = torch.arange(1, len(used) + 1)
    return codes, len(used)


def pattern_matrix(patterns: list[bytes], width: int) -> torch.Tensor:
    """(k, width) uint8: each pattern's bytes, zero-padded (or cut) to `width`."""
    rows = bytearray()
    for p in patterns:
        rows += p[:width].ljust(width, b"\0")
    return torch.frombuffer(rows, dtype=torch.uint8).reshape(len(patterns), width).clone()
