"""Adapting to the hardware's speed: each data-parallel rank's share of the global batch from
its measured speed, with hysteresis, and naming a rank persistently slower than its peers.

Torch-free and deterministic in its inputs: every rank of a run feeds it the same numbers (the
step's one all-reduce gives every rank the same per-rank times, phalanx/train/step_sync.py), so
every rank reaches the same shares at the same step without a collective of its own. The
planner may read the same arithmetic for mixed clusters.

Shares are whole sequences. Which sequences a rank reads is `share_rows`: rank r takes the
contiguous rows after ranks 0 .. r-1, so equal shares are the slices phalanx always used.

Speed is sequences per second of compute (`shares[r] / compute_s[r]`, the rank's step time
less its waits in collectives). A rank's step time is about its share over its speed, the
step's time the slowest rank's, so shares in proportion to speed make every rank finish
together (`proportional_shares`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median
from typing import Sequence


@dataclass(frozen=True, kw_only=True)
class AdaptRules:
    """How eagerly shares follow speeds, and when a slow rank is named; plain data on the
    training Job (phalanx/train/job.py)."""
    window: int = 8
    """Steps of speeds a decision looks at: each rank's median over them, so one slow step (a
    checkpoint's copy, a page fault) moves nothing. After a change the window starts empty:
    the new shares' speeds are measured before the next decision."""
    band: float = 0.10
    """Hysteresis: shares change only when the step time predicted with the new ones is at
    least this fraction below the current shares' (from the same speeds). Step-to-step
    compute-time noise measured on the shared 2-core machine (benchmarks/straggler.py, equal
    shares, no competitor): 1.2-1.7% median absolute deviation per rank for the `small` model's
    0.25 s steps, 3.3-4.5% for `tiny`'s 20 ms steps, single steps up to 20% apart between the
    ranks; the window's median removes the single steps. 10% keeps shares still when speeds
    wobble within that, and a shift worth one sequence of a rank's 8 (12.5%) still moves them."""
    straggler_margin: float = 0.25
    """A rank whose compute time exceeds its peers' median by more than this fraction ..."""
    straggler_steps: int = 5
    """... for this many steps in a row is named in a `straggler` event (once, until it
    recovers). 25%: above the noise (`band`) and its single steps up to 20% apart (another
    process's burst on the core), which 5 steps in a row rule out as well; a rank at 2/3 of its
    peers' speed (50% longer) is named, and a rank beside a busy process (1.8x its peer's
    compute time in benchmarks/straggler.py) is named at step 5."""

    def __post_init__(self) -> None:
        if self.window < 1 or self.straggler_steps < 1 or not 0 <= self.band < 1 or self.straggler_margin <= 0:
            raise ValueError(f"invalid adaptation rules {self}")


def equal_shares(total: int, ranks: int) -> tuple[int, ...]:
    """`total` sequences over `ranks` as evenly as possible, the first ranks one more."""
    base, extra = divmod(total, ranks)
    return tuple(base + (rank < extra) for rank in range(ranks))


def share_rows(shares: Sequence[int], rank: int) -> tuple[int, int]:
    """The [start, stop) rows of the global batch that `rank` reads: after ranks 0 .. rank-1."""
    start = sum(shares[:rank])
    return start, start + shares[rank]


def proportional_shares(speeds: Sequence[float], total: int, *, minimum: int = 1) -> tuple[int, ...]:
    """`total` whole sequences in proportion to `speeds`, each rank at least `minimum`.

    Each rank's ideal share is total x speed / sum of speeds; shares start at the ideal's
    floor (raised to `minimum`), then sequences are taken from the ranks furthest above their
    ideal (only while above the minimum) or given to those furthest below it, ties to the
    lower rank. Speeds [2, 1] over 12 sequences give [8, 4]."""
    if len(speeds) * minimum > total:
        raise ValueError(f"{total} sequences cannot give {len(speeds)} ranks {minimum} each")
    if any(not math.isfinite(s) or s <= 0 for s in speeds):
        raise ValueError(f"speeds must be positive and finite, got {list(speeds)}")
    whole = sum(speeds)
    ideal = [total * speed / whole for speed in speeds]
    shares = [max(minimum, math.floor(x)) for x in ideal]
    ranks = range(len(shares))
    while sum(shares) > total:
        r = max((r for r in ranks if shares[r] > minimum), key=lambda r: (shares[r] - ideal[r], -r))
        shares[r] -= 1
    while sum(shares) < total:
        r = max(ranks, key=lambda r: (ideal[r] - shares[r], -r))
        shares[r] += 1
    return tuple(shares)


def predicted_step_s(shares: Sequence[int], speeds: Sequence[float]) -> float:
    """The step's compute time with `shares` at `speeds`: the slowest rank's share / speed."""
    return max(n / s for n, s in zip(shares, speeds))


@dataclass
class ShareGovernor:
    """The data-parallel shares of a run: `observe` each step's per-rank speeds; it returns
    an `adapt` event row when the shares change (they apply from the next step)."""
    shares: tuple[int, ...]
    rules: AdaptRules = field(default_factory=AdaptRules)
    minimum: int = 1
    """Fewest sequences a rank may get: one per gradient-accumulation micro-batch."""
    history: list[tuple[float, ...]] = field(default_factory=list)

    def observe(self, step: int, speeds: Sequence[float]) -> dict | None:
        """`speeds`: sequences per second of compute per rank in `step` (which ran with the
        current shares). A rank with no measurement (0, or not finite) skips the step."""
        if len(speeds) != len(self.shares):
            raise ValueError(f"{len(speeds)} speeds for {len(self.shares)} ranks")
        if any(not math.isfinite(s) or s <= 0 for s in speeds):
            return None
        self.history = [*self.history, tuple(speeds)][-self.rules.window:]
        if len(self.history) < self.rules.window:
            return None
        smooth = [median(step_speeds[r] for step_speeds in self.history) for r in range(len(self.shares))]
        proposed = proportional_shares(smooth, sum(self.shares), minimum=self.minimum)
        now, then = predicted_step_s(self.shares, smooth), predicted_step_s(proposed, smooth)
        if proposed == self.shares or then > now * (1 - self.rules.band):
            return None
        fastest = max(smooth)
        relative = ", ".join(f"{s / fastest:.2f}" for s in smooth)
        reason = (f"speeds relative to the fastest rank {relative} (median of {self.rules.window} steps): "
                  f"predicted compute {now:.3f} s -> {then:.3f} s per step")
        self.shares, self.history = proposed, []
        return {"event": "adapt", "step": step, "shares": list(proposed), "reason": reason}


def data_parallel_peers(world: int, *, dp: int, cp: int = 1, tp: int = 1) -> list[list[int]]:
    """Groups of ranks that do the same work on different sequences: the same pipeline stage,
    tp rank and cp rank, each dp rank once (rank = ((pp_rank x dp + dp_rank) x cp + cp_rank) x
    tp + tp_rank, docs/layout.md). Stages of a pipeline, or the cp ranks of a sequence, differ
    in work by design; only such peers tell a slow device."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for rank in range(world):
        tp_rank, rest = rank % tp, rank // tp
        cp_rank, rest = rest % cp, rest // cp
        groups.setdefault((rest // dp, cp_rank, tp_rank), []).append(rank)
    return list(groups.values())


@dataclass
class StragglerWatch:
    """Names a rank whose compute time stays above its peers' median (`AdaptRules`' margin
    and number of steps); `observe` returns the step's `straggler` event rows."""
    rules: AdaptRules = field(default_factory=AdaptRules)
    peers: list[list[int]] | None = None
    """Groups of ranks that do the same work (`data_parallel_peers`); None: all ranks."""
    slow_for: dict[int, int] = field(default_factory=dict)
    """Steps in a row each rank has been slow (absent: not slow last step)."""

    def observe(self, step: int, compute_s: Sequence[float]) -> list[dict]:
        events = []
        groups = self.peers if self.peers is not None else [list(range(len(compute_s)))]
        for rank, group in sorted((rank, group) for group in groups if len(group) > 1 for rank in group):
            mine = compute_s[rank]
            peers = median(compute_s[r] for r in group if r != rank)
            if mine > peers * (1 + self.rules.straggler_margin):
                self.slow_for[rank] = self.slow_for.get(rank, 0) + 1
                if self.slow_for[rank] == self.rules.straggler_steps:
                    events.append({"event": "straggler", "step": step, "rank": rank, "compute_s": round(mine, 4),
                                   "median_s": round(peers, 4)})
            else:
                self.slow_for.pop(rank, None)
        return events


def adaptation_refusal(*, dp: int, tp: int, pp: int, cp: int, ep: int, sharded: bool, replica_groups: int,
                       compile: bool, moe: bool) -> str:
    """Why this layout keeps equal data-parallel shares ('' when it adapts). Only replicated
    data parallelism (DDP) adapts: its waits are measured apart from compute (the gradient
    all-reduce after the rank's last gradient). The rest is not done yet, each for its reason."""
    if dp < 2:
        return "one data-parallel rank"
    others = [f"{name}={value}" for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)) if value > 1]
    if others:
        return f"{','.join(others)} with dp: only plain data parallelism adapts yet"
    if sharded:
        return "zero/fsdp: FSDP's gathers and reduce-scatters wait inside forward and backward, not yet measured apart from compute"
    if replica_groups > 1:
        return "replica groups: their shares of the global batch are fixed by the group count"
    if compile:
        return "--compile: a changed share would recompile the blocks"
    if moe:
        return "MoE models: their balance losses and expert loads are per-rank statistics"
    return ""
