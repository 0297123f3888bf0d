"""Pipeline parallelism with `torch.distributed.pipelining`: stages are deletions, then a schedule.

Each stage is a full `Transformer` built on the meta device from which the modules the stage
does not own were deleted (the forward skips what is missing). A rank owns one stage
(gpipe, 1f1b) or several "virtual" chunks: round-robin for interleaved (rank r holds stages
r, r + pp, ...), V-shaped for zbv and dualpipev (rank r holds stages r and 2 pp - 1 - r, so the
first and the last stage share rank 0).

The chunks of a rank are gathered in a `StageModules` container that registers their modules
under the model's own names ("layers.3.attention.wq.weight"): optimizer, checkpoints,
layout-independent init and weight comparison all see ordinary parameter names.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import pipelining as pl

from phalanx import layout_rules as rules
from phalanx.model.transformer import Transformer
from phalanx.parallel.context_parallel import document_ids
from phalanx.plan import Plan

SINGLE_STAGE = ("gpipe", "1f1b")


def stages_of_rank(plan: Plan, pp_rank: int) -> list[int]:
    """Stage indices held by `pp_rank`, in the order the schedule expects (layout_rules)."""
    return rules.stages_of_rank(plan.schedule, pp_rank, plan.pp, plan.virtual)


def keep_only(model: Transformer, names: list[str]) -> Transformer:
    """Delete from `model` every top-level part and layer not named in `names`."""
    for part in ("tok_embeddings", "norm", "output"):
        if part not in names:
            setattr(model, part, None)
    for key in list(model.layers.keys()):
        if f"layers.{key}" not in names:
            del model.layers[key]
    return model


class StageModules(nn.Module):
    """This rank's pipeline chunks, with their modules registered under the model's names.

    Only a container: the schedule runs `chunks[i]` (each a pruned Transformer); this module
    is never called. Its parameters are the chunks' parameters, once each.
    """
    def __init__(self, chunks: list[Transformer], stage_indices: list[int]):
        super().__init__()
        self.chunks = chunks  # a plain list: not registered, so names carry no "chunks.0."
        self.stage_indices = stage_indices
        self.layers = nn.ModuleDict()
        for chunk in chunks:
            for part in ("tok_embeddings", "norm", "output"):
                if getattr(chunk, part) is not None:
                    setattr(self, part, getattr(chunk, part))
            for key, layer in chunk.layers.items():
                self.layers[key] = layer

    def forward(self, *args):
        raise RuntimeError("StageModules is a container; the pipeline schedule runs its chunks")

    def train(self, mode: bool = True) -> "StageModules":
        super().train(mode)
        for chunk in self.chunks:  # not children, so not reached by the call above
            chunk.train(mode)
        return self


class MicrobatchDocuments:
    """`--doc-mask` through a schedule: each stage's forward and backward of micro-batch i runs
    under the document ids of micro-batch i (`context_parallel.document_ids`).

    A schedule runs the micro-batches of a step in its own order, forwards of some between the
    backwards of others (1f1b, interleaved, the V shapes), and recomputation (`recompute=full`)
    runs a micro-batch's forward again inside its backward; so the ids are set around every
    call that runs one micro-batch on a stage, by its index, not once per step."""
    CALLS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
    """PipelineStage's methods that run one micro-batch, its index their first argument."""
    def __init__(self, n_microbatches: int):
        self.n_microbatches = n_microbatches
        self.parts: tuple[torch.Tensor, ...] | None = None

    def wrap(self, stage) -> None:
        for name in self.CALLS:
            original = getattr(stage, name, None)
            if original is None:
                continue

            def run(index, *args, _original=original, **kwargs):
                if self.parts is None:
                    return _original(index, *args, **kwargs)
                with document_ids(self.parts[index]):
                    return _original(index, *args, **kwargs)

            setattr(stage, name, run)

    @contextlib.contextmanager
    def step(self, documents: torch.Tensor | None):
        """Around one `schedule.step`: `documents` (batch, seq) of this rank's whole batch,
        cut as the schedule cuts the inputs (`tensor_split` on dim 0)."""
        if documents is None:
            yield
            return
        self.parts = documents.tensor_split(self.n_microbatches)
        try:
            # Also the first step's shape-inference forward, which runs on micro-batch 0's shapes.
            with document_ids(self.parts[0]):
                yield
        finally:
            self.parts = None


@dataclass
class Pipeline:
    """Everything the training step needs to run one rank's share of the pipeline."""
    schedule: object
    stage_indices: list[int]
    n_stages: int
    has_first: bool
    has_last: bool
    documents: MicrobatchDocuments


_METADATA_FORWARDS = ("_forward_metadata_inference", "_shape_inference")
"""Names torch's PipelineStage has used for the forward that learns the shapes a stage sends
(torch 2.13, and earlier). Private; where neither exists nothing is wrapped."""


def _metadata_forward_in_eval(stage) -> None:
    """Run the stage's shape-inference forward with its module in eval mode.

    Without input/output shapes given, a stage learns them on the first step by running its
    module once more, outside the schedule's micro-batches (on the first micro-batch, or on
    empty tensors of the received shapes). That forward is not training: in train mode it
    would add a micro-batch of (partly uninitialized) tokens to the MoE load counters and
    leave an auxiliary loss behind. Eval mode gives the same shapes and dtypes.
    """
    for name in _METADATA_FORWARDS:
        original = getattr(stage, name, None)
        if original is None:
            continue

        def in_eval(*args, _original=original, **kwargs):
            module, was_training = stage.submod, stage.submod.training
            module.train(False)
            try:
                return _original(*args, **kwargs)
            finally:
                module.train(was_training)

        setattr(stage, name, in_eval)
        return


def build_schedule(plan: Plan, stage_modules: list[nn.Module], stage_indices: list[int], pp_group,
                   device: torch.device, loss_fn) -> Pipeline:
    """Wrap each chunk in a PipelineStage and make the plan's schedule over them."""
    n_stages = plan.pp * plan.virtual
    stages = [
        pl.PipelineStage(module, index, n_stages, device, group=pp_group)
        for module, index in zip(stage_modules, stage_indices)
    ]
    documents = MicrobatchDocuments(plan.num_microbatches)
    for stage in stages:
        _metadata_forward_in_eval(stage)
        documents.wrap(stage)
    kinds = {
        "gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B, "interleaved": pl.ScheduleInterleaved1F1B,
        "zbv": pl.ScheduleZBVZeroBubble, "dualpipev": pl.ScheduleDualPipeV,
    }
    kind = kinds[plan.schedule]
    # scale_grads: each micro-batch loss is a mean over its tokens; dividing the summed
    # gradients by the micro-batch count makes them the gradient of the whole batch's mean.
    target = stages[0] if plan.schedule in SINGLE_STAGE else stages
    schedule = kind(target, n_microbatches=plan.num_microbatches, loss_fn=loss_fn, scale_grads=True)
    return Pipeline(
        schedule=schedule, stage_indices=stage_indices, n_stages=n_stages,
        has_first=0 in stage_indices, has_last=n_stages - 1 in stage_indices, documents=documents,
    )


def bubble_formula(plan: Plan) -> float:
    """The schedule's idle fraction of a step, assuming every micro-batch's forward, backward
    (and, split, input-grad and weight-grad) take the same time on every stage and sends are
    free. p = pp, m = micro-batches, v = chunks per rank:

    - gpipe, 1f1b:  (p - 1) / (m + p - 1)   (1f1b only saves memory, not time)
    - interleaved:  (p - 1) / (v m + p - 1) (each warm-up slot is a v-times-smaller chunk)
    - zbv:          0 once m >= 2p: weight-gradient work fills the warm-up and cool-down slots
    - dualpipev:    (p/2 - 1)(F&B + B - 3W) / step = 0 when F = B = W and F&B = F + B
    The measured value also includes time waiting on slower stages and on transfers.
    """
    p, m, v = plan.pp, plan.num_microbatches, plan.virtual
    if p == 1 or plan.schedule in rules.V_SCHEDULES:
        return 0.0
    if plan.schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)
