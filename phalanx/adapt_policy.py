"""Adapting to the hardware's speed: each data-parallel rank's share of the global batch from
its measured speed, with hysteresis; a pipeline's layers re-split between its stages from
their measured times, when the gain beats the cost; and naming a rank persistently slower than
its peers.

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

A pipeline stage's time is its layers' cost (FLOPs, `parallel/stage_split.unit_costs`) times
its seconds per FLOP, measured: the stage's compute time over its layers' cost. A re-split
keeps each stage's seconds per FLOP and moves layers so that the slowest stage is as fast as
possible (`weighted_layer_counts`, `SplitGovernor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median
from typing import Sequence

from phalanx.errors import UserError


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


def weighted_layer_counts(costs: Sequence[float], scales: Sequence[float]) -> list[int]:
    """Layers per stage (contiguous, at least one each) that minimize the most expensive stage,
    stage s's cost being its units' cost times `scales[s]` (its seconds per unit of cost; all
    equal: the cost-balanced split). Of equally good splits, the earliest cuts win.

    `costs` is [embedding, layers..., output] (`parallel/stage_split.unit_costs`): the embedding
    goes with the first stage, the output with the last. Exact dynamic programme over
    contiguous cuts, O(stages x layers^2). Costs [0, 1, 1, 1, 1, 0] with scales [1, 3] give
    [3, 1]: the first stage's three layers take 3, the second's one 3 x 1 = 3."""
    n_stages = len(scales)
    embed, layers, output = costs[0], costs[1:-1], costs[-1]
    n = len(layers)
    if n_stages < 1 or n < n_stages:
        raise UserError(f"{n_stages} pipeline stages need at least {n_stages} layers; the model has {n}")
    prefix = [0.0]
    for cost in layers:
        prefix.append(prefix[-1] + cost)

    def stage_cost(s: int, lo: int, hi: int) -> float:
        own = prefix[hi] - prefix[lo] + (embed if s == 1 else 0.0) + (output if s == n_stages else 0.0)
        return own * scales[s - 1]

    # best[s][i]: (max stage cost, cuts) for the first i layers over the first s stages.
    inf = float("inf")
    best: list[list[tuple[float, tuple[int, ...]]]] = [[(inf, ())] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, ())
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                prev, cuts = best[s - 1][j]
                if prev == inf:
                    continue
                worst = max(prev, stage_cost(s, j, i))
                # Strictly better only: of equal splits, keep the one with the earliest cuts.
                if worst < best[s][i][0] * (1 - 1e-12):
                    best[s][i] = (worst, cuts + (i - j,))
    return list(best[n_stages][n][1])


def stage_costs(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Each stage's cost under `counts` layers per stage (embedding first, output last)."""
    out, first = [], 1
    for s, count in enumerate(counts):
        cost = sum(costs[first:first + count])
        cost += (costs[0] if s == 0 else 0.0) + (costs[-1] if s == len(counts) - 1 else 0.0)
        out.append(cost)
        first += count
    return out


@dataclass
class SplitGovernor:
    """A pipeline's layers per stage: `observe` each step's per-rank compute seconds; it
    returns an `adapt` event row when the layers should move (applied after the step's update:
    `pending`), that is when the step time predicted with the new split is `band` below the
    current one and the time saved over the steps left exceeds `cost_s`, what a re-split costs.
    A split run within the last `RECENT` windows counts at its measured time where that is
    worse than predicted.

    One stage per pp rank (gpipe, 1f1b: `split_adaptation_refusal`). A pp rank's time is the
    slowest of its ranks (dp, cp, tp): they run the stage in step with each other."""
    counts: tuple[int, ...]
    costs: tuple[float, ...]
    """[embedding, layers..., output], from `parallel/stage_split.unit_costs`."""
    ranks: list[list[int]]
    """The global ranks of each pp rank."""
    rules: AdaptRules = field(default_factory=AdaptRules)
    cost_s: float = 0.0
    """Seconds a re-split costs (a checkpoint saved and loaded, the model rebuilt), every rank's
    slowest: the last re-split's, measured; before the first, the run's setup time (building
    the model and its optimizer), an underestimate that leaves out the checkpoint's save and
    load (tiny model on CPU, tests/test_adapt_split_training.py: setup 0.04 s, a re-split
    0.2 s), so at most the first re-split can cost more than it was weighed at."""
    history: list[tuple[float, ...]] = field(default_factory=list)
    pending: tuple[int, ...] | None = None
    """The split decided, applied after the step's update."""
    measured: dict[tuple[int, ...], tuple[float, int]] = field(default_factory=dict)
    """Splits run so far: (their slowest stage's median time, the step it was measured at)."""

    def observe(self, step: int, compute_s: Sequence[float], steps_left: int) -> dict | None:
        """`compute_s`: every global rank's compute seconds in `step` (run with the current
        split); `steps_left`: the steps the run still has to run after it."""
        times = tuple(max(compute_s[r] for r in ranks) for ranks in self.ranks)
        if any(not math.isfinite(t) or t <= 0 for t in times):
            return None
        self.history = [*self.history, times][-self.rules.window:]
        if len(self.history) < self.rules.window:
            return None
        smooth = [median(h[p] for h in self.history) for p in range(len(self.ranks))]
        scales = [t / c for t, c in zip(smooth, stage_costs(self.costs, self.counts))]  # seconds per unit of cost
        proposed = tuple(weighted_layer_counts(self.costs, scales))
        now = max(smooth)
        self.measured[self.counts] = (now, step)
        then = max(k * c for k, c in zip(scales, stage_costs(self.costs, proposed)))
        # A split run recently was measured, which beats predicting it: a stage's time is not
        # all in proportion to its layers' FLOPs (host work, the output's softmax), and the
        # prediction alone sent a quiet run back and forth between two splits
        # (benchmarks/straggler.py --plan pp=2,...). Older than RECENT windows, speeds may have moved.
        if proposed in self.measured and step - self.measured[proposed][1] <= RECENT * self.rules.window:
            then = max(then, self.measured[proposed][0])
        # The slowest stage's compute time bounds the step's (the others wait on it); the
        # saving counts that alone, not the bubble it also shortens: an underestimate.
        gain = (now - then) * steps_left
        if proposed == self.counts or then > now * (1 - self.rules.band) or gain <= self.cost_s:
            return None
        fastest = min(scales)
        relative = ", ".join(f"{fastest / k:.2f}" for k in scales)
        reason = (f"stage speeds relative to the fastest {relative} (median of {self.rules.window} steps): "
                  f"predicted slowest stage {now:.3f} s -> {then:.3f} s per step, {gain:.1f} s saved over "
                  f"{steps_left} steps against {self.cost_s:.2f} s to re-split")
        self.history, self.pending = [], proposed
        return {"event": "adapt", "step": step, "split": ":".join(map(str, proposed)), "reason": reason}

    def applied(self, cost_s: float) -> None:
        """The pending split is in place; it took `cost_s` (every rank's slowest)."""
        self.counts, self.pending, self.cost_s = self.pending, None, cost_s


RECENT = 4
"""Windows for which a split's measured time stands in for its prediction (`SplitGovernor`):
long enough to stop a run returning to a split it just left as slower, short enough that a
change of speeds since (a competitor starting or stopping) is measured afresh."""


def split_adaptation_refusal(*, pp: int, schedule: str, replica_groups: int, compile: bool, expert_slots: int) -> str:
    """Why this layout keeps its pipeline split ('' when it adapts)."""
    if pp < 2:
        return "one pipeline stage"
    if schedule not in ("gpipe", "1f1b"):
        return f"schedule={schedule}: a rank holds several stages, whose times are not measured apart yet"
    if replica_groups > 1:
        return "replica groups: a re-split would need every group to rebuild at the same step"
    if compile:
        return "--compile: a re-split recompiles every block, a cost not measured before deciding"
    if expert_slots:
        return "expert slots: their placement is not rebuilt with the model yet"
    return ""


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
