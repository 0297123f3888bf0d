"""`phalanx.kernels.match` finds exactly what pyahocorasick finds (counts and sorted
positions), for both algorithms, on random and real inputs, across every shard boundary, and on
1, 2 and 4 ranks. Matching is exact, so every comparison is equality."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import ahocorasick
import pytest

from phalanx.kernels import match
from phalanx.kernels import matching
from phalanx.kernels.matching import MatchJob, match_rank, merge_results

ALGORITHMS = ("wu-manber", "pfac")


def reference(patterns: list[bytes], data: list[bytes]) -> tuple[list[int], list[list[int]]]:
    """pyahocorasick's matches (its automaton holds str: bytes go through latin-1)."""
    automaton = ahocorasick.Automaton()
    for index, pattern in enumerate(patterns):
        automaton.add_word(pattern.decode("latin-1"), (index, len(pattern)))
    automaton.make_automaton()
    counts, positions = [0] * len(patterns), []
    for input_index, text in enumerate(data):
        for end, (index, length) in automaton.iter(text.decode("latin-1")):
            counts[index] += 1
            positions.append([input_index, end - length + 1, index])
    return counts, sorted(positions)


def naive(patterns: list[bytes], data: list[bytes]) -> list[list[int]]:
    found = []
    for input_index, text in enumerate(data):
        for index, pattern in enumerate(patterns):
            at = text.find(pattern)
            while at >= 0:
                found.append([input_index, at, index])
                at = text.find(pattern, at + 1)
    return sorted(found)


def tricky_patterns(rng: random.Random, data: list[bytes], alphabet: bytes, count: int) -> list[bytes]:
    """Substrings of the data (so they match), random strings, and prefixes and extensions of
    earlier patterns (overlapping, sharing prefixes, prefixes of each other); no newline."""
    chosen: dict[bytes, None] = {}
    while len(chosen) < count:
        roll = rng.random()
        if roll < 0.5 and any(len(t) > 12 for t in data):
            text = rng.choice([t for t in data if len(t) > 12])
            start = rng.randrange(len(text) - 12)
            pattern = text[start : start + rng.randint(1, 12)]
        elif roll < 0.8 or not chosen:
            pattern = bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 10)))
        else:
            base = rng.choice(list(chosen))
            pattern = base[: rng.randint(1, len(base))] + bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
        if pattern and b"\n" not in pattern:
            chosen[pattern] = None
    return list(chosen)


def check(patterns, data, **kwargs):
    counts, positions = reference(patterns, data)
    result = match(patterns, data, positions=True, **kwargs)
    assert list(result) == ["matches", "per_pattern", "bytes", "seconds", "positions"]
    assert result["per_pattern"] == counts
    assert result["matches"] == sum(counts)
    assert result["positions"] == positions
    assert result["bytes"] == sum(map(len, data))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("alphabet", [b"ab", b"ACGT", bytes(b for b in range(256) if b != 10)])
def test_random_inputs_match_pyahocorasick(algorithm, alphabet):
    rng = random.Random(len(alphabet) * 7 + len(algorithm))
    for _ in range(3):
        data = [bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 1500))) for _ in range(rng.randint(1, 4))]
        patterns = tricky_patterns(rng, data, alphabet, rng.randint(1, 80))
        check(patterns, data, algorithm=algorithm)
        assert naive(patterns, data) == reference(patterns, data)[1]  # the reference itself, checked


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_shard_boundary_on_1_2_and_4_ranks(algorithm, monkeypatch):
    """Chunks of 50 bytes, on 1, 2 and 4 ranks (each rank's share computed here, in turn): a
    pattern lies across every chunk and rank boundary, and matches never span two inputs."""
    monkeypatch.setitem(matching.CHUNK_BYTES, "cpu", 50)
    rng = random.Random(1)
    data = [bytes(rng.choice(b"abc\0\xff") for _ in range(n)) for n in (997, 3, 0, 640)]
    text = b"".join(data)
    patterns = {text[b - cut : b - cut + length]: None for b in range(25, len(text), 25)
                for cut, length in ((1, 2), (3, 7), (6, 12))}
    patterns = [p for p in patterns if b"\n" not in p] + tricky_patterns(rng, data, b"abc\0\xff", 40)
    patterns = list(dict.fromkeys(patterns))
    counts, positions = reference(patterns, data)
    starts = (0, 997, 1000, 1000, 1640)
    for world_size in (1, 2, 4):
        job = MatchJob(patterns, text, starts, algorithm, "cpu", positions=True)
        result = merge_results([match_rank(rank, world_size, job) for rank in range(world_size)], len(text), True)
        assert result["per_pattern"] == counts, world_size
        assert result["positions"] == positions, world_size


def test_stdlib_source_with_10000_patterns():
    """Real text: 10,000 patterns drawn from 30 kB of the standard library's source, and
    1 pattern, both algorithms and auto."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = [path.read_bytes()[:5000] for path in sorted(root.glob("*.py"))[:6]]
    rng = random.Random(2)
    drawn: dict[bytes, None] = {}
    while len(drawn) < 10_000:
        text = rng.choice(data)
        start = rng.randrange(max(1, len(text) - 30))
        pattern = text[start : start + rng.randint(2, 30)]
        if pattern and b"\n" not in pattern:
            drawn[pattern] = None
    patterns = list(drawn)
    for algorithm in ALGORITHMS:
        check(patterns, data, algorithm=algorithm)
    check([b"self"], data)


def test_two_elastic_workers_find_the_same_matches():
    """The multi-process path: 2 workers started by the elastic launcher, sharding the text."""
    rng = random.Random(3)
    data = [bytes(rng.choice(b"ACGT") for _ in range(5000)) for _ in range(2)]
    patterns = tricky_patterns(rng, data, b"ACGT", 50)
    check(patterns, data, nproc=2)
