"""PFAC: the Parallel Failure-less Aho-Corasick of Lin et al. (2013). The automaton is the
patterns' trie with no failure links; a lane starts at every text position and follows the trie
until it falls off, reporting each pattern-ending state it passes. All lanes step together as
tensor operations, and dead lanes are dropped after each step, so the work is the number of
(position, depth) pairs still inside the trie: small when patterns are short or the alphabet
makes the trie's upper levels fill up quickly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.kernels.alphabet import byte_codes

DEAD, ROOT = 0, 1  # state 0 loops to itself: a lane that fell off the trie


@dataclass
class PfacTables:
    base: int  # alphabet size + 1
    codes: torch.Tensor  # (256,) byte -> code
    goto: torch.Tensor  # (states * base,) next state of (state, code); DEAD when the trie has none
    output: torch.Tensor  # (states,) the pattern ending at a state, -1 if none
    longest: int


def build_tables(patterns: list[bytes], device: torch.device | str = "cpu") -> PfacTables:
    codes, alphabet = byte_codes(patterns)
    base = alphabet + 1
    code_of = codes.tolist()
    children: dict[tuple[int, int], int] = {}
    ends: dict[int, int] = {}
    states = 2
    for index, pattern in enumerate(patterns):
        state = ROOT
        for byte in pattern:
            key = (state, code_of[byte])
            child = children.get(key)
            if child is None:
                child = children[key] = states
                states += 1
            state = child
        ends[state] = index
    goto = torch.zeros(states * base, dtype=torch.int64)
    if children:
        keys = torch.tensor(list(children.keys()), dtype=torch.int64)  # (edges, 2): state, code
        goto[keys[:, 0] * base + keys[:, 1]] = torch.tensor(list(children.values()), dtype=torch.int64)
    output = torch.full((states,), -1, dtype=torch.int64)
    output[torch.tensor(list(ends.keys()))] = torch.tensor(list(ends.values()))
    return PfacTables(base, codes.to(device), goto.to(device), output.to(device), max(map(len, patterns)))


def scan(tables: PfacTables, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every occurrence in `text` (uint8 (n,), on the tables' device): (starts, pattern indexes)."""
    n = text.numel()
    codes = tables.codes[text.long()]  # (n,)
    starts = torch.arange(n, device=text.device)  # one lane per start byte
    state = tables.goto[ROOT * tables.base + codes]  # after one byte
    found_starts, found_patterns = [], []
    for depth in range(1, tables.longest + 1):
        alive = state != DEAD
        starts, state = starts[alive], state[alive]
        pattern = tables.output[state]
        hit = pattern >= 0
        found_starts.append(starts[hit])
        found_patterns.append(pattern[hit])
        inside = starts + depth < n
        starts, state = starts[inside], state[inside]
        if starts.numel() == 0:
            break
        state = tables.goto[state * tables.base + codes[starts + depth]]
    if not found_starts:
        empty = torch.empty(0, dtype=torch.int64, device=text.device)
        return empty, empty
    return torch.cat(found_starts), torch.cat(found_patterns)
