"""Wu-Manber multi-pattern matching (Wu & Manber, "A fast algorithm for multi-pattern
searching", 1994) as tensor operations: the same SHIFT, HASH and PREFIX tables over B-byte
blocks, scanned with one lane per text position instead of one sliding window.

Serially, the window of the m shortest-pattern bytes ending at text position i slides by
SHIFT[h(block ending at i)]; only a shift of 0 leads to HASH and PREFIX and a comparison. With
a lane per position every window is looked at anyway, so the scan keeps exactly the lanes whose
SHIFT is 0 (the serial algorithm's candidates), keeps those some pattern fits
through HASH and PREFIX, and verifies the survivors.

HASH (patterns by the hash of their m-prefix's last block) and PREFIX (their first two bytes)
are kept as one sorted array of the (last-block hash, prefix) keys that some pattern has: a
lane looks up both at once by binary search, and survives if its key is there. Serially, each
pattern of the HASH bucket with the right PREFIX is then compared in turn; on source code,
where hundreds of patterns share their first bytes (indentation), that would make dozens of
comparisons per text byte, so the survivors are verified for all patterns and lengths at once
by phalanx/kernels/verify.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from phalanx.kernels.alphabet import byte_codes, pattern_matrix
from phalanx.kernels.verify import LengthIndex, build_index, verify

TABLE_SIZE = 1 << 20  # block hashes are exact below this many distinct blocks, folded above
FOLD_PRIME = 1048573  # largest prime below 2**20: folding by it spreads blocks over the table


def choose_block(shortest: int, count: int, alphabet: int) -> int:
    """The paper's rule B = log_c(2 M), M = k * m (k patterns, m the shortest length, c the
    alphabet), rounded up, at least 1 and at most m (a block must fit in every pattern)."""
    c = max(alphabet, 2)
    return max(1, min(shortest, math.ceil(math.log(2 * count * shortest) / math.log(c))))


def block_hashes(codes: torch.Tensor, block: int, base: int) -> torch.Tensor:
    """Hash of every `block`-long run of codes along the last dim: (..., n) -> (..., n - block + 1)."""
    n = codes.shape[-1]
    exact = base ** block <= TABLE_SIZE
    h = codes[..., : n - block + 1].clone()
    for t in range(1, block):
        h.mul_(base).add_(codes[..., t : n - block + 1 + t])
        if not exact:
            h %= FOLD_PRIME
    return h


@dataclass
class WuManberTables:
    block: int  # B
    shortest: int  # m
    base: int  # alphabet size + 1 (code 0: a byte in no pattern)
    codes: torch.Tensor  # (256,) int32 byte -> code
    shift: torch.Tensor  # (TABLE_SIZE,) int8 SHIFT (capped at 127)
    slot_key: torch.Tensor  # (distinct,) sorted HASH x PREFIX keys: last-block hash * base**2 + first two codes
    index: LengthIndex  # the verification's tables (phalanx/kernels/verify.py)


def build_tables(patterns: list[bytes], device: torch.device | str = "cpu") -> WuManberTables:
    codes, alphabet = byte_codes(patterns)
    base, m, k = alphabet + 1, min(map(len, patterns)), len(patterns)
    block = choose_block(m, k, alphabet)
    prefix_codes = codes[pattern_matrix(patterns, m).long()]  # (k, m)
    hashes = block_hashes(prefix_codes, block, base)  # (k, m - block + 1): block starting at q
    # SHIFT: a block ending q bytes before the window's end may move the window by q, no more.
    distance = torch.arange(m - block, -1, -1).expand_as(hashes)  # (k, m - block + 1)
    shift = torch.full((TABLE_SIZE,), m - block + 1, dtype=torch.int64)
    shift.scatter_reduce_(0, hashes.reshape(-1), distance.reshape(-1), reduce="amin")
    shift = shift.clamp_(max=127).to(torch.int8)  # only "is it 0" is read: 1 MB instead of 8
    last = hashes[:, -1]  # (k,) hash of each m-prefix's last block: where SHIFT is 0
    prefix = prefix_codes[:, 0] * base + (prefix_codes[:, 1] if m > 1 else 0)
    keys = torch.unique(last * base * base + prefix)
    return WuManberTables(block, m, base, codes.to(device, torch.int32), shift.to(device), keys.to(device),
                          build_index(patterns, device))


def scan(tables: WuManberTables, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every occurrence in `text` (uint8 (n,), on the tables' device): (starts, pattern indexes)."""
    m, n = tables.shortest, text.numel()
    if n < m:
        empty = torch.empty(0, dtype=torch.int64, device=text.device)
        return empty, empty
    # int32 lanes (block hashes < 2**20 * base): half the memory traffic of int64.
    codes = tables.codes.index_select(0, text.int())  # (n,)
    last = block_hashes(codes, tables.block, tables.base)[m - tables.block :]  # (n - m + 1,): window at s
    starts = torch.nonzero(tables.shift.index_select(0, last) == 0).squeeze(1)  # candidates: SHIFT is 0
    prefix = codes.index_select(0, starts).long() * tables.base
    if m > 1:
        prefix += codes.index_select(0, starts + 1)
    keys = last.index_select(0, starts).long() * (tables.base * tables.base) + prefix
    at = torch.searchsorted(tables.slot_key, keys).clamp_(max=tables.slot_key.numel() - 1)
    fits = torch.nonzero(tables.slot_key.index_select(0, at) == keys).squeeze(1)  # some pattern has this HASH and PREFIX
    return verify(tables.index, text, starts.index_select(0, fits))
