"""A discrete-event run of one serving instance: arrivals, batching, KV capacity and
preemption, on a simulated clock, torch-free.

Every dp rank runs `phalanx serve`'s own scheduler (phalanx/scheduling/scheduler.py: decodes first,
chunked prefill within the step's token budget, blocks from the paged pool, newest-first
preemption with recompute) over a block pool the size the planner gives the rank; a step lasts
what the step model (serve/step.py) says for the batch the scheduler chose. Arrivals go to
the dp rank with the fewest sequences (running + waiting), the lowest index on a tie. Under
ep > 1 the dp ranks step together (the MoE all-to-all is collective: a step lasts the slowest
rank's, and a rank with nothing to do still waits), otherwise each on its own clock.

`simulate(...)` with a `step_seconds` function of the step is what tests drive with a fixed
cost; `step_model_seconds` is the step model's.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Callable

from phalanx.planner.serve.step import ServeLayout, step_time
from phalanx.scheduling.scheduler import Scheduler, Sequence, Step


@dataclass(frozen=True)
class Arrival:
    at: float
    """Seconds since the start."""
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class StepRecord:
    rank: int
    start: float
    end: float
    decodes: int
    prompt_tokens: int
    preempted: int


@dataclass
class SimResult:
    requests: list[Sequence] = field(default_factory=list)
    """In arrival order, with arrival, first_token_at and finished_at set."""
    steps: list[StepRecord] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    """Request ids in the order they first joined a running batch."""
    completed: list[str] = field(default_factory=list)
    preemptions: int = 0

    def ttfts(self) -> list[float]:
        return sorted(s.first_token_at - s.arrival for s in self.requests if s.first_token_at is not None)

    def tpots(self) -> list[float]:
        return sorted((s.finished_at - s.first_token_at) / (len(s.output) - 1) for s in self.requests
                      if s.finished_at is not None and len(s.output) > 1)


def poisson_arrivals(rate: float, count: int, *, isl: int, osl: int, seed: int = 0) -> list[Arrival]:
    """`count` requests of fixed lengths at Poisson times of `rate` per second (seeded)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(Arrival(t, isl, osl))
    return out


def step_model_seconds(model, cluster, layout: ServeLayout, *, world: int, costs=None) -> Callable[[Step], float]:
    """The step model's time of a scheduled step: its decodes at their mean context and its
    prompt chunks at theirs, through the pp stages in turn."""
    cache: dict[tuple[int, int, int, int], float] = {}

    def seconds(step: Step) -> float:
        decodes = [c for c in step.chunks if c.length == 1]
        prompts = [c for c in step.chunks if c.length > 1]
        context = sum(c.start for c in decodes) / len(decodes) if decodes else 0.0
        tokens = sum(c.length for c in prompts)
        prefix = sum((c.start + c.length / 2) * c.length for c in prompts) / tokens if tokens else 0.0
        key = (len(decodes), int(context) // 16, tokens, int(prefix) // 16)  # 16-position buckets
        if key not in cache:
            pp = layout.pp
            cache[key] = pp * step_time(model, cluster, layout, decodes=len(decodes) / pp, context=context,
                                        prefill_tokens=tokens / pp, prefill_context=prefix, world=world,
                                        costs=costs).seconds
        return cache[key]

    return seconds


def simulate(arrivals: list[Arrival], *, ranks: int, lockstep: bool, num_blocks: int, block_size: int,
             max_batch: int, max_batch_tokens: int, step_seconds: Callable[[Step], float],
             seed: int = 0) -> SimResult:
    """Run `arrivals` through `ranks` dp ranks' schedulers until every request has finished."""
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731  (the schedulers read the simulated time)
    schedulers = [Scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_batch,
                            max_num_batched_tokens=max_batch_tokens, max_waiting=10**9, clock=clock)
                  for _ in range(ranks)]
    rng = random.Random(seed)
    result = SimResult()
    pending = sorted(arrivals, key=lambda a: a.at)
    nxt = 0
    seen: set[int] = set()

    def admit_until(t: float) -> None:
        nonlocal nxt
        while nxt < len(pending) and pending[nxt].at <= t:
            a = pending[nxt]
            prompt = [rng.randrange(1, 2**31) for _ in range(a.prompt_tokens)]  # unique: no prefix hits
            seq = Sequence.of(f"r{nxt}", prompt, a.output_tokens, arrival=a.at)
            target = min(range(ranks), key=lambda r: (len(schedulers[r].running) + len(schedulers[r].waiting), r))
            schedulers[target].add(seq)
            result.requests.append(seq)
            nxt += 1

    def run_step(rank: int, step: Step, start: float, end: float) -> None:
        for chunk in step.chunks:
            if id(chunk.seq) not in seen:
                seen.add(id(chunk.seq))
                result.admitted.append(chunk.seq.seq_id)
        now[0] = end
        sampled = {id(c.seq): 0 for c in step.chunks if c.samples}
        for seq in schedulers[rank].finish_step(step, sampled):
            result.completed.append(seq.seq_id)
        decodes = sum(1 for c in step.chunks if c.length == 1)
        result.steps.append(StepRecord(rank, start, end, decodes, step.num_tokens - decodes, len(step.preempted)))
        result.preemptions += len(step.preempted)

    # Event loop: (time a rank, or the lockstep group, is free, rank).
    free = [(0.0, r) for r in range(1 if lockstep else ranks)]
    heapq.heapify(free)
    while free:
        t, rank = heapq.heappop(free)
        now[0] = t
        admit_until(t)
        group = range(ranks) if lockstep else [rank]
        if not any(schedulers[r].has_work() for r in group):
            if nxt >= len(pending):
                continue  # this rank is done for good
            heapq.heappush(free, (max(t, pending[nxt].at), rank))
            continue
        steps = {r: schedulers[r].schedule() for r in group}
        length = max((step_seconds(s) for s in steps.values() if s.chunks), default=0.0)
        for r, step in steps.items():
            if step.chunks:
                run_step(r, step, t, t + length)
        if length <= 0:  # work that no step can take: the pool cannot hold a waiting request at all
            raise RuntimeError(f"rank {rank}: requests wait but none fits the {num_blocks}-block pool")
        now[0] = t + length
        heapq.heappush(free, (t + length, rank))
    return result


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of sorted `values`, by the nearest rank; nan when empty."""
    if not values:
        return float("nan")
    index = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[index]
