"""Attention data parallelism on rank 0's side (`--plan dp=N,ep=N`): one scheduler per dp rank,
each over its own rank's KV blocks, and which of them a new request joins.

Each dp rank runs its own sequences in its own paged cache, so a sequence lives on one rank from
its first token to its last (preempted, it is recomputed on the same rank). A new request goes
to the rank with the fewest sequences (running and waiting), the lowest rank among equals: plain
logic, like the scheduler's, testable without processes.

`DPSchedulers` answers what the engine loop and /metrics ask of a `Scheduler` (add, abort,
finish, the running and waiting sequences, block and prefix-cache totals) over all dp ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.scheduling.scheduler import Scheduler, Sequence


def assign_rank(schedulers: list[Scheduler]) -> int:
    """The dp rank a new request joins: the fewest sequences running and waiting, lowest first."""
    loads = [len(s.running) + len(s.waiting) for s in schedulers]
    return loads.index(min(loads))


@dataclass(frozen=True)
class BlockTotals:
    num_blocks: int
    num_used: int
    num_free: int


class DPSchedulers:
    slo = None
    """Latency targets (--ttft-ms/--tpot-ms) are refused with dp > 1 (serve/cli.py)."""

    def __init__(self, schedulers: list[Scheduler]):
        self.parts = schedulers
        self.block_size = schedulers[0].block_size

    def owner(self, seq: Sequence) -> Scheduler | None:
        for part in self.parts:
            if seq in part.running or seq in part.waiting:
                return part
        return None

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        self.parts[0].check_fits(prompt_len, max_tokens)  # every rank's pool has the same size

    def add(self, seq: Sequence) -> None:
        self.parts[assign_rank(self.parts)].add(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> bool:
        part = self.owner(seq)
        return part.abort(seq, reason) if part is not None else False

    def finish(self, seq: Sequence, reason: str) -> None:
        part = self.owner(seq)
        (part or self.parts[0]).finish(seq, reason)

    def has_work(self) -> bool:
        return any(part.has_work() for part in self.parts)

    @property
    def running(self) -> list[Sequence]:
        return [seq for part in self.parts for seq in part.running]

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for part in self.parts for seq in part.waiting]

    @property
    def blocks(self) -> BlockTotals:
        return BlockTotals(*(sum(getattr(part.blocks, name) for part in self.parts)
                             for name in ("num_blocks", "num_used", "num_free")))

    @property
    def prefix_query_tokens(self) -> int:
        return sum(part.prefix_query_tokens for part in self.parts)

    @property
    def prefix_hit_tokens(self) -> int:
        return sum(part.prefix_hit_tokens for part in self.parts)

    @property
    def preemptions(self) -> int:
        return sum(part.preemptions for part in self.parts)

    @property
    def guessed_tokens(self) -> int:
        return sum(part.guessed_tokens for part in self.parts)

    @property
    def kept_guesses(self) -> int:
        return sum(part.kept_guesses for part in self.parts)
