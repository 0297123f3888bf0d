"""One optimizer step's forward and backward through a pipeline schedule.

The schedule splits this data-parallel rank's batch into the plan's micro-batches, runs
them through the stages, and computes the loss on the rank that holds the last stage (rank
pp - 1, or rank 0 for the V-shaped schedules). That rank's micro-batch losses are summed
over the pp group, so every rank, rank 0 included, returns the same loss to log.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.parallel.mesh import ParallelMesh
from phalanx.parallel.pipeline import Pipeline, build_schedule
from phalanx.parallel.tensor_parallel import loss_context


def token_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (logits may be vocab-sharded)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_pipeline(model, mesh: ParallelMesh) -> Pipeline:
    return build_schedule(mesh.plan, model.chunks, model.stage_indices, mesh.group("pp"), mesh.device, token_loss)


class WaitClock:
    """Seconds this rank spends blocked on pipeline sends and receives.

    The schedules wait for their point-to-point transfers through one module function
    (`schedules._wait_batch_p2p`, present in torch 2.11 to 2.13); it is wrapped once per process
    to add up those waits. Where a torch version lacks it, `available` is False and the bubble
    is reported as unmeasured (None) rather than guessed.
    """

    seconds = 0.0
    available = False

    @classmethod
    def install(cls) -> None:
        from torch.distributed.pipelining import schedules

        original = getattr(schedules, "_wait_batch_p2p", None)
        cls.available = original is not None
        if original is None or getattr(original, "phalanx_timed", False):
            return

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                cls.seconds += time.perf_counter() - began

        timed.phalanx_timed = True
        schedules._wait_batch_p2p = timed


def pipeline_step(pipeline: Pipeline, mesh: ParallelMesh, inputs: torch.Tensor, targets: torch.Tensor,
                  *, autocast, evaluate: bool = False) -> torch.Tensor:
    """Forward and backward (or with `evaluate`, forward only) of this dp rank's batch;
    returns its mean loss, the same on every pp rank."""
    losses: list[torch.Tensor] = []
    with loss_context(mesh.plan), autocast():
        kwargs = {"target": targets if pipeline.has_last else None, "losses": losses}
        args = (inputs,) if pipeline.has_first else ()
        if evaluate:
            pipeline.schedule.eval(*args, **kwargs)
        else:
            pipeline.schedule.step(*args, **kwargs)
    loss = torch.zeros((), device=mesh.device)
    if pipeline.has_last:
        values = [l.full_tensor() if hasattr(l, "full_tensor") else l for l in losses]
        loss = torch.stack([v.detach().float() for v in values]).mean()
    dist.all_reduce(loss, group=mesh.group("pp"))  # only the last stage's rank adds a value
    return loss


def bubble_record(wait_s: float, step_time_s: float, plan, mesh: ParallelMesh) -> dict:
    """The step's measured bubble (each pp rank's waiting time / step time) beside the
    schedule's formula. Collective over the pp group: every rank must call it."""
    from phalanx.parallel.pipeline import bubble_formula

    record: dict = {"bubble_formula": bubble_formula(plan)}
    if not WaitClock.available:
        record["bubble"] = None
        return record
    waits = [torch.zeros((), dtype=torch.float64) for _ in range(plan.pp)]
    dist.all_gather(waits, torch.tensor(wait_s, dtype=torch.float64), group=mesh.group("pp"))
    by_stage = [round(float(w) / step_time_s, 4) for w in waits]
    record.update(bubble=sum(by_stage) / len(by_stage), bubble_by_rank=by_stage)
    return record
