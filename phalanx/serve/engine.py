"""One engine step: the scheduler's batch through the model, then a token for each sequence
whose chunk reached its end.

The engine composes the parts vLLM's engine has, each in a file with one job: the scheduler
(`scheduling/scheduler.py`, plain data) picks the step; the input batch (`input_batch.py`)
turns it into at most two forwards and the changes to the block tables every rank keeps
(`block_tables.py`); the model runner (`model_runner.py`) runs them on this rank's model and
paged cache; the step sampler (`step_sampler.py`) draws the tokens and closes the step.
Under a parallel layout rank 0 sends each step's message to the other ranks first
(`launch/rank_loop.RankChannel`), whose runners run the same forwards (`launch/rank_loop.follow`).
Attention data parallelism composes the same parts per dp rank (`dp_engine.py`).
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch

from phalanx.scheduling.scheduler import Scheduler, Sequence
from phalanx.thread_tuner import ThreadTuner
from phalanx.serve.block_tables import BlockTables
from phalanx.serve.expert_loads import ExpertLoads
from phalanx.serve.input_batch import step_message
from phalanx.serve.model_runner import ModelRunner
from phalanx.serve.mtp_draft import MtpDraft
from phalanx.serve.step_sampler import StepSampler, TokenEvent


class Engine:
    def __init__(self, model: torch.nn.Module, scheduler: Scheduler, device: torch.device | str = "cpu",
                 on_logits: Callable[[Sequence, torch.Tensor], None] | None = None, channel=None,
                 expert_ranks: int = 1, compile: bool = False, tuner: ThreadTuner | None = None,
                 mtp: torch.nn.Module | None = None):
        """`on_logits(seq, logits)` sees the logits (vocab,) each token was picked from (tests).
        `channel`: rank 0's `launch.rank_loop.RankChannel` under a parallel layout (the other ranks
        run the same forwards). `expert_ranks`: the ep degree (the ranks expert loads are
        counted over). `compile`: decodes through a compiled graph where the model allows
        (`compiled_decode.py`). `tuner`: re-decides the intra-op thread count from the steps'
        speed (`thread_tuner.py`; a single process whose count is automatic). `mtp`: the model's
        multi-token-prediction layer, whose draft after each step is the next step's guess
        (`mtp_draft.py`; one process)."""
        self.scheduler, self.channel, self.tuner = scheduler, channel, tuner
        self.runner = ModelRunner(model, device, scheduler.blocks.num_blocks, scheduler.block_size, compile)
        self.sampler = StepSampler(on_logits)
        self.expert_loads = ExpertLoads(model, expert_ranks)
        self.draft = None if mtp is None else MtpDraft(mtp, self.runner, scheduler.speculative.num_speculative_tokens)
        self.sent = BlockTables()
        """The block tables as the ranks hold them since the last message."""
        self.steps = 0

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    def step(self) -> list[TokenEvent]:
        """Schedule, run the model, sample; the new tokens (with the finished sequences)."""
        step = self.scheduler.schedule()
        if not step.chunks:
            return []
        if self.tuner is None:
            return self._run(step)
        threads = self.tuner.next_threads()
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        began = time.perf_counter()
        events = self._run(step)
        switches = len(self.tuner.switches)
        self.tuner.observe(time.perf_counter() - began, sum(chunk.length for chunk in step.chunks))
        if len(self.tuner.switches) > switches:
            was, now, ratio = self.tuner.switches[-1]
            print(f"phalanx: intra-op threads {was} -> {now}: {1 / ratio:.2f}x faster steps per token with {now} "
                  "(thread_tuner.py)", file=sys.stderr, flush=True)
        return events

    def _run(self, step) -> list[TokenEvent]:
        message, reads = step_message(step, self.scheduler.running, self.sent)
        if self.channel is not None:
            self.channel.send(message)
        logits = self.runner.run_message(message)
        self.steps += 1
        events = self.sampler.sample(self.scheduler, step, logits, reads)
        if self.draft is not None:
            self.draft.after_step(step, message, self.scheduler)
        return events

    def take_expert_rows(self) -> list[list[int]] | None:
        """Routed rows per rank of each MoE layer since the last call (None without MoE)."""
        return self.expert_loads.take()

    def close(self) -> None:
        """Stop the other ranks, if any."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
