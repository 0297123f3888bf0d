"""One engine step under attention data parallelism (`--plan dp=N,ep=N`, docs/serve.md).

Rank 0 holds one scheduler per dp rank (`dp_assign.py`); each step every scheduler picks its
rank's batch, and rank 0 broadcasts all of them at once (`DPStep`: per dp rank its forwards, as
`engine.Forward` plain data). Every rank runs its own forwards on its own paged cache and
replicated attention weights; the experts are spread over the ep ranks, and in every MoE layer
the rows travel to their experts and back by all-to-all (`phalanx.parallel.expert`), so the
ranks of an ep group must run the same number of forwards in lockstep. A rank with fewer
forwards than the most any rank runs this step runs filler forwards: one token written into a
scratch block of its cache that no sequence owns, its logits dropped and its routed rows left
out of the expert loads. The logits (and each rank's expert counts) are gathered to rank 0,
which samples every dp rank's tokens.

With `--expert-slots`/`--rebalance-every` a new placement decided by rank 0 after a step rides
in the next step's message, and every rank moves its expert weights to it before that step's
forwards (`expert_placement.py`): a step boundary, with no request stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from phalanx.serve.dp_assign import DPSchedulers
from phalanx.serve.engine import Engine, Forward, TokenEvent, step_forwards
from phalanx.serve.paged_cache import ChunkLayout


@dataclass(frozen=True)
class DPStep:
    """What rank 0 broadcasts each step under attention data parallelism."""
    forwards: list[list[Forward]]
    """Per dp rank, its forwards (at most two: decodes and prompt chunks)."""
    placement: object | None = None
    """A new expert placement (`expert_placement.NewPlacement`) to install before the forwards."""


class DPEngine(Engine):
    def __init__(self, model: torch.nn.Module, scheduler: DPSchedulers, device, *, dp_rank: int, channel=None,
                 expert_ranks: int = 1, placement=None, on_rebalance: Callable | None = None):
        """`scheduler`: every dp rank's scheduler (only rank 0 schedules; the other ranks read
        their pool size from it). `placement`: a `LivePlacement` with expert slots; rank 0
        re-plans with it and calls `on_rebalance(event)` after each move."""
        super().__init__(model, scheduler, device, channel=channel, expert_ranks=expert_ranks)
        blocks = scheduler.parts[0].blocks.num_blocks
        # One more block than the scheduler hands out: the filler forwards' scratch block.
        self.cache = self.new_cache(blocks + 1, scheduler.block_size)
        self.filler = Forward([0], [ChunkLayout([blocks], 0, 1)], [0])
        self.dp_rank, self.placement, self.on_rebalance = dp_rank, placement, on_rebalance
        self._rows: list[list[int]] | None = None

    def step(self) -> list[TokenEvent]:
        """Every dp rank's batch through its rank; sampling and bookkeeping here (rank 0)."""
        parts = self.scheduler.parts
        steps = [part.schedule() for part in parts]
        if not any(step.chunks for step in steps):
            return []
        planned = [step_forwards(step) for step in steps]  # per dp rank: (forwards, rows read)
        order = DPStep([forwards for forwards, _ in planned],
                       self.placement.take_pending() if self.placement is not None else None)
        self.channel.send(order)
        results = self.run_order(order)
        self.steps += 1
        events = []
        for part, step, (_, reads), (logits, _) in zip(parts, steps, planned, results):
            events += self.sample(part, step, logits, reads)
        self._count_loads([loads for _, loads in results])
        return events

    @torch.no_grad()
    def run_order(self, order: DPStep) -> list | None:
        """Every rank: install a new placement, run this rank's forwards and fillers, and send
        (logits (rows read, vocab), expert counts) to rank 0, which gets all ranks' in
        rank order (dp rank = global rank: dp is not combined with tp)."""
        if order.placement is not None:
            self.placement.install(order.placement)
        mine = order.forwards[self.dp_rank]
        logits = [self.run_model(forward) for forward in mine]
        with self.expert_loads.ignored():
            for _ in range(max(map(len, order.forwards)) - len(mine)):
                self.run_model(self.filler)
        result = (torch.cat(logits) if logits else torch.empty(0), self.expert_loads.take_counts())
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered

    def _count_loads(self, loads: list) -> None:
        """Sum the dp ranks' expert counts: rows per ep rank for /metrics, and with slots the
        rows per expert and per rank for the rebalancer."""
        loads = [load for load in loads if load is not None]
        if not loads:
            return
        experts = sum(load[0] for load in loads)  # (layers, experts)
        ranks = sum(load[1] for load in loads)  # (layers, ep ranks)
        self._rows = ranks.tolist() if self._rows is None else (torch.tensor(self._rows) + ranks).tolist()
        if self.placement is not None:
            event = self.placement.observe(self.steps, experts.numpy(), ranks.numpy())
            if event is not None and self.on_rebalance is not None:
                self.on_rebalance(event)

    def take_expert_rows(self) -> list[list[int]] | None:
        rows, self._rows = self._rows, None
        return rows

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
