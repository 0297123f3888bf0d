"""One engine step under attention data parallelism (`--plan dp=N,ep=N`, docs/serve.md).

Rank 0 holds one scheduler per dp rank (`dp_assign.py`); each step every scheduler picks its
rank's batch, and rank 0 broadcasts all of them at once (`DPStep`: per dp rank its
`input_batch.StepMessage`, plain data). Every rank's `DPRunner` runs its own forwards on its own
paged cache and replicated attention weights; the experts are spread over the ep ranks, and in every MoE layer
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

from phalanx.serve.block_tables import BlockTables
from phalanx.serve.dp_assign import DPSchedulers
from phalanx.serve.expert_loads import ExpertLoads
from phalanx.serve.input_batch import Forward, StepMessage, step_message
from phalanx.serve.model_runner import ModelRunner
from phalanx.serve.step_sampler import StepSampler, TokenEvent

FILLER = -1
"""The serial of the filler forwards' block table: one scratch block no sequence owns."""


@dataclass(frozen=True)
class DPStep:
    """What rank 0 broadcasts each step under attention data parallelism."""
    messages: list[StepMessage]
    """Per dp rank, its step: its block tables' changes and its forwards (at most two)."""
    placement: object | None = None
    """A new expert placement (`expert_placement.NewPlacement`) to install before the forwards."""


class DPRunner:
    """Every rank's side: its dp rank's forwards on its model runner, filler forwards to keep
    the ep group in lockstep, and (logits, expert counts) gathered to rank 0."""

    def __init__(self, model: torch.nn.Module, device, num_blocks: int, block_size: int, *, dp_rank: int,
                 expert_ranks: int, placement=None):
        # One more block than the scheduler hands out: the filler forwards' scratch block.
        self.runner = ModelRunner(model, device, num_blocks + 1, block_size)
        self.runner.tables.tables[FILLER] = [num_blocks]
        self.filler = Forward([0], [(FILLER, 0, 1)], [0])
        self.dp_rank, self.placement = dp_rank, placement
        self.expert_loads = ExpertLoads(model, expert_ranks)

    @torch.no_grad()
    def run_message(self, order: DPStep) -> list | None:
        """Install a new placement, run this rank's forwards and fillers, and send (logits
        (rows read, vocab), expert counts) to rank 0, which gets all ranks' in rank order
        (dp rank = global rank: dp is not combined with tp)."""
        if order.placement is not None:
            self.placement.install(order.placement)
        mine = order.messages[self.dp_rank]
        self.runner.tables.apply(mine.tables)
        logits = [self.runner.run(forward) for forward in mine.forwards]
        with self.expert_loads.ignored():
            for _ in range(max(len(message.forwards) for message in order.messages) - len(mine.forwards)):
                self.runner.run(self.filler)
        # To the host before pickling: gather_object would unpickle a GPU tensor onto rank 0's device anyway.
        result = (torch.cat(logits).cpu() if logits else torch.empty(0), self.expert_loads.take_counts())
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered


class DPEngine:
    def __init__(self, model: torch.nn.Module, scheduler: DPSchedulers, device, *, dp_rank: int, channel=None,
                 expert_ranks: int = 1, placement=None, on_rebalance: Callable | None = None):
        """`scheduler`: every dp rank's scheduler (only rank 0 schedules; the other ranks read
        their pool size from it). `placement`: a `LivePlacement` with expert slots; rank 0
        re-plans with it and calls `on_rebalance(event)` after each move."""
        self.scheduler, self.channel = scheduler, channel
        self.runner = DPRunner(model, device, scheduler.parts[0].blocks.num_blocks, scheduler.block_size,
                               dp_rank=dp_rank, expert_ranks=expert_ranks, placement=placement)
        self.sampler = StepSampler()
        self.sent = [BlockTables() for _ in scheduler.parts]
        """Per dp rank, its block tables as that rank holds them since the last message."""
        self.placement, self.on_rebalance = placement, on_rebalance
        self.steps = 0
        self._rows: list[list[int]] | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.runner.model

    def step(self) -> list[TokenEvent]:
        """Every dp rank's batch through its rank; sampling and bookkeeping here (rank 0)."""
        parts = self.scheduler.parts
        steps = [part.schedule() for part in parts]
        if not any(step.chunks for step in steps):
            return []
        planned = [step_message(step, part.running, sent) for step, part, sent in zip(steps, parts, self.sent)]
        order = DPStep([message for message, _ in planned],
                       self.placement.take_pending() if self.placement is not None else None)
        self.channel.send(order)
        results = self.runner.run_message(order)
        self.steps += 1
        events = []
        for part, step, (_, reads), (logits, _) in zip(parts, steps, planned, results):
            events += self.sampler.sample(part, step, logits, reads)
        self._count_loads([loads for _, loads in results])
        return events

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
        """Stop the other ranks."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
