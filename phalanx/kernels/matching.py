"""`phalanx.kernels.match`: every occurrence of every pattern in a list of texts.

The texts are laid end to end in one buffer (input boundaries remembered), split into one
contiguous share per rank, and each share into chunks that fit the device; each chunk is read
with an overlap of the longest pattern minus one byte (phalanx/kernels/shards.py). A match is
kept by the chunk that owns its start and only if it ends inside the input it starts in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from phalanx.errors import UserError
from phalanx.kernels import pfac, wu_manber
from phalanx.kernels.patterns import check_patterns
from phalanx.kernels.shards import rank_chunks
from phalanx.kernels.workers import run_sharded, worker_device

ALGORITHMS = ("auto", "wu-manber", "pfac")
# Bytes of text per scan on one device: every byte is a lane holding a few int32 values (codes,
# block hashes), so a CPU chunk costs ~15x its size in memory, and 4 MB amortizes each op's
# fixed cost; a GPU's memory and parallelism take bigger ones.
CHUNK_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}


def choose_algorithm(patterns: list[bytes], algorithm: str = "auto") -> str:
    """`auto`: Wu-Manber, unless its blocks would be one byte long (a pattern of one or two
    bytes, or a tiny alphabet against many patterns): then every text byte that ends some
    pattern's first block is a candidate, and PFAC, whose lanes die at the first mismatch, wins."""
    if algorithm not in ALGORITHMS:
        raise UserError(f"--algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    if algorithm != "auto":
        return algorithm
    alphabet = len(set().union(*(set(p) for p in patterns)))
    block = wu_manber.choose_block(min(map(len, patterns)), len(patterns), alphabet)
    return "pfac" if block < 2 else "wu-manber"


@dataclass(frozen=True)
class MatchJob:
    patterns: list[bytes]
    text: bytes  # the inputs end to end
    input_starts: tuple[int, ...]  # where each input begins, then the total length
    algorithm: str  # "wu-manber" or "pfac"
    device: str
    positions: bool


def match_rank(rank: int, world_size: int, job: MatchJob) -> dict:
    """This rank's share: per-pattern counts and, if asked, (input, offset, pattern) arrays."""
    began = time.perf_counter()
    device = worker_device(job.device)
    engine = wu_manber if job.algorithm == "wu-manber" else pfac
    tables = engine.build_tables(job.patterns, device)
    lengths = torch.tensor([len(p) for p in job.patterns], device=device)
    bounds = torch.tensor(job.input_starts, device=device)  # (inputs + 1,)
    counts = torch.zeros(len(job.patterns), dtype=torch.int64, device=device)
    text = torch.frombuffer(bytearray(job.text), dtype=torch.uint8) if job.text else torch.empty(0, dtype=torch.uint8)
    found: list[tuple[torch.Tensor, ...]] = []
    overlap = int(lengths.max()) - 1
    for piece in rank_chunks(text.numel(), rank, world_size, overlap, CHUNK_BYTES[device.type]):
        starts, patterns = engine.scan(tables, text[piece.own_start : piece.read_end].to(device))
        starts = starts + piece.own_start
        inputs = torch.searchsorted(bounds, starts, right=True) - 1
        keep = (starts < piece.own_end) & (starts + lengths[patterns] <= bounds[inputs + 1])
        starts, patterns, inputs = starts[keep], patterns[keep], inputs[keep]
        counts += torch.bincount(patterns, minlength=len(job.patterns))
        if job.positions:
            found.append((inputs.cpu(), (starts - bounds[inputs]).cpu(), patterns.cpu()))
    result = {"per_pattern": counts.cpu().numpy()}
    if job.positions:
        result["positions"] = [torch.cat(column).numpy() if column else np.empty(0, np.int64) for column in zip(*found)] \
            if found else [np.empty(0, np.int64)] * 3
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result["seconds"] = time.perf_counter() - began
    return result


def match(patterns: list[bytes], data: list[bytes], *, algorithm: str = "auto", device: str = "cpu",
          nproc: int = 1, positions: bool = False) -> dict:
    """Every occurrence, overlapping ones included, of each pattern in each text.

    Returns {"matches": total, "per_pattern": [n0, n1, ...], "bytes": total text bytes,
    "seconds": time of the matching itself (the slowest rank's, plus merging; not the start of
    worker processes)} and with `positions`, "positions": sorted [input, offset, pattern] triples.
    """
    check_patterns(patterns)
    patterns = [bytes(p) for p in patterns]
    chosen = choose_algorithm(patterns, algorithm)
    starts = [0]
    for index, item in enumerate(data):
        if not isinstance(item, (bytes, bytearray)):
            raise UserError(f"input {index} is {type(item).__name__}, not bytes")
        starts.append(starts[-1] + len(item))
    job = MatchJob(patterns, b"".join(data), tuple(starts), chosen, device, positions)
    return merge_results(run_sharded(match_rank, job, nproc, device), starts[-1], positions)


def merge_results(results: list[dict], total_bytes: int, positions: bool) -> dict:
    """One answer from the ranks' results (in any order)."""
    merging = time.perf_counter()
    per_pattern = np.sum([r["per_pattern"] for r in results], axis=0)
    answer = {"matches": int(per_pattern.sum()), "per_pattern": per_pattern.tolist(), "bytes": total_bytes}
    if positions:
        inputs, offsets, pattern = (np.concatenate(column) for column in zip(*(r["positions"] for r in results)))
        order = np.lexsort((pattern, offsets, inputs))
        found = np.stack([inputs[order], offsets[order], pattern[order]], axis=1).tolist()
    answer["seconds"] = max(r["seconds"] for r in results) + time.perf_counter() - merging
    if positions:
        answer["positions"] = found
    return answer
