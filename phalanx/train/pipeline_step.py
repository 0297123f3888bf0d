"""One optimizer step's forward and backward through a pipeline schedule.

The schedule splits this data-parallel rank's batch into the plan's micro-batches, runs
them through the stages, and computes the loss on the rank that holds the last stage (rank
pp - 1, or rank 0 for the V-shaped schedules). That rank's micro-batch losses are summed
over the pp group, so every rank, rank 0 included, returns the same loss to log.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules

from phalanx.parallel.context_parallel import WholeSequence, document_ids
from phalanx.parallel.mesh import ParallelMesh
from phalanx.parallel.pipeline import Pipeline, bubble_formula, build_schedule, stages_of_rank
from phalanx.parallel.tensor_parallel import loss_context
from phalanx.train.loss import token_loss


def make_pipeline(model, mesh: ParallelMesh) -> Pipeline:
    return build_schedule(mesh.plan, model.chunks, model.stage_indices, mesh.group("pp"), mesh.device, token_loss)


class WaitClock:
    """Seconds this rank spent blocked on pipeline sends and receives in one step; the step
    makes one and reads it after (`pipeline_step(..., clock=)`).

    The schedules wait for their point-to-point transfers through one module function
    (`schedules._wait_batch_p2p`, private but long-standing); `timing()` replaces it with a
    timed wrapper for the step's schedule only and puts the original back after, so nothing
    else in the process (another schedule, a test, calibration) sees the replacement. Where a
    torch version lacks it, `available` stays False and the bubble is reported as unmeasured
    (None) rather than guessed. This is host time: with gloo the host blocks until data
    arrives; with NCCL a wait only orders CUDA streams, so on GPUs this clock undercounts
    (measuring there needs CUDA events, not done yet).
    """
    def __init__(self) -> None:
        self.seconds = 0.0
        self.available = False

    @contextlib.contextmanager
    def timing(self):
        original = getattr(schedules, "_wait_batch_p2p", None)
        self.available = original is not None
        if original is None:
            yield self
            return

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began

        schedules._wait_batch_p2p = timed
        try:
            yield self
        finally:
            schedules._wait_batch_p2p = original


def pipeline_step(pipeline: Pipeline, mesh: ParallelMesh, inputs: torch.Tensor, targets: torch.Tensor,
                  *, autocast, clock: WaitClock | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Forward and backward of this dp rank's batch; returns its mean loss, the same on
    every pp rank. `clock`: adds up the time the schedule waited on transfers, and the loss's
    all-reduce after it (where stages that are done wait for the others). `documents`:
    with `--doc-mask`, the batch's document ids (batch, seq), cut per micro-batch."""
    losses: list[torch.Tensor] = []
    with loss_context(mesh.plan), autocast(), (clock.timing() if clock else contextlib.nullcontext()), \
            pipeline.documents.step(documents):
        kwargs = {"target": targets if pipeline.has_last else None, "losses": losses}
        args = (inputs,) if pipeline.has_first else ()
        pipeline.schedule.step(*args, **kwargs)
    loss = torch.zeros((), device=mesh.device)
    if pipeline.has_last:
        values = [l.full_tensor() if hasattr(l, "full_tensor") else l for l in losses]
        loss = torch.stack([v.detach().float() for v in values]).mean()
    began = time.perf_counter()
    dist.all_reduce(loss, group=mesh.group("pp"))  # only the last stage's rank adds a value
    if clock is not None:
        # Waiting too: the stages that finished their part of the schedule first (the last,
        # under 1F1B) wait here for the rest, and a stage's compute time must not count it.
        clock.seconds += time.perf_counter() - began
    return loss


def bubble_record(clock: WaitClock, step_time_s: float, plan, mesh: ParallelMesh) -> dict:
    """The step's measured bubble (each pp rank's waiting time / step time) beside the
    schedule's formula. Collective over the pp group: every rank must call it."""
    record: dict = {"bubble_formula": bubble_formula(plan)}
    if not clock.available:
        record["bubble"] = None
        return record
    # On the mesh's device: NCCL only moves accelerator tensors.
    waits = [torch.zeros((), dtype=torch.float64, device=mesh.device) for _ in range(plan.pp)]
    dist.all_gather(waits, torch.tensor(clock.seconds, dtype=torch.float64, device=mesh.device), group=mesh.group("pp"))
    by_stage = [round(float(w) / step_time_s, 4) for w in waits]
    record.update(bubble=sum(by_stage) / len(by_stage), bubble_by_rank=by_stage)
    return record


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def pipeline_forward(model, mesh: ParallelMesh, inputs: torch.Tensor, *, on_output, cache=None) -> None:
    """Forward only, `inputs` as one micro-batch, stage after stage through the pp ranks;
    calls `on_output(logits)` on the rank holding the last stage. Used for validation and
    sampling: simpler than a schedule's `eval` (which the V-shaped schedules do not support),
    and the same for every schedule. Run under `torch.no_grad()`.

    Hidden states travel between the pp ranks that hold consecutive stages, preceded by their
    shape and dtype (the receiver does not know the sequence split or the autocast dtype).
    Each rank visits its stages in increasing order, so the sends form one chain: no cycles.
    `cache`: an `AttentionCache` every chunk's attention asks instead (sampling's `WholeSequence`).
    """
    plan = mesh.plan
    group = mesh.group("pp")
    me = mesh.axis_rank("pp")
    owner = {stage: r for r in range(plan.pp) for stage in stages_of_rank(plan, r)}
    chunks = dict(zip(model.stage_indices, model.chunks))
    n_stages = plan.pp * plan.virtual
    hidden = inputs
    for stage in range(n_stages):
        if owner[stage] != me:
            continue
        source = owner.get(stage - 1, me)
        if source != me:
            header = torch.zeros(4, dtype=torch.int64, device=mesh.device)
            dist.recv(header, group=group, group_src=source)  # (batch, seq, dim, dtype index)
            hidden = torch.empty(tuple(header[:3].tolist()), dtype=_DTYPES[int(header[3])], device=mesh.device)
            dist.recv(hidden, group=group, group_src=source)
        hidden = chunks[stage](hidden) if cache is None else chunks[stage](hidden, cache)
        if stage == n_stages - 1:
            on_output(hidden)
        elif owner[stage + 1] != me:
            header = torch.tensor([*hidden.shape, _DTYPES.index(hidden.dtype)], dtype=torch.int64, device=mesh.device)
            dist.send(header, group=group, group_dst=owner[stage + 1])
            dist.send(hidden.contiguous(), group=group, group_dst=owner[stage + 1])


@torch.no_grad()
def pipeline_forward_loss(model, mesh: ParallelMesh, inputs: torch.Tensor, targets: torch.Tensor, *,
                          autocast, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Mean loss of (inputs, targets) through the pipeline, the same on every pp rank.
    `documents`: with `--doc-mask`, their document ids (batch, seq)."""
    loss = torch.zeros((), device=mesh.device)

    def keep_loss(logits) -> None:
        value = token_loss(logits, targets)
        loss.copy_((value.full_tensor() if hasattr(value, "full_tensor") else value).float())

    with loss_context(mesh.plan), autocast(), document_ids(documents):
        pipeline_forward(model, mesh, inputs, on_output=keep_loss)
    dist.all_reduce(loss, group=mesh.group("pp"))  # only the last stage's rank adds a value
    return loss


def pipeline_next_logits(model, mesh: ParallelMesh, vocab_size: int):
    """For sampling: a function from ids (1, seq) to the logits (vocab,) at position `seq - 1`
    (after right padding, see `generate`), the same on every pp rank."""
    @torch.no_grad()
    def next_logits(ids: torch.Tensor, position: int) -> torch.Tensor:
        logits = torch.zeros(vocab_size, device=mesh.device)

        def keep(output) -> None:
            full = output.full_tensor() if hasattr(output, "full_tensor") else output  # (1, seq, vocab)
            logits.copy_(full[0, position].float())

        # Every rank runs the whole prompt (no KV cache here): attention over it alone, not
        # cp's view of a sequence split over ranks nor --doc-mask's documents.
        pipeline_forward(model, mesh, ids, on_output=keep, cache=WholeSequence())
        dist.all_reduce(logits, group=mesh.group("pp"))  # only the last stage's rank adds a value
        return logits

    return next_logits
