"""Tensor and sequence parallelism: the model's matrices become DTensors sharded over "tp".

The plan is data: a table from module name (relative to a block, or to the model root) to a
`parallelize_module` style. Attention and the MLP follow the Megatron pattern: the first
matrices are split by output columns (each rank computes a slice of the heads / hidden units
with no communication), the second by input rows (each rank's partial sum is all-reduced).
The embedding is split by vocabulary rows and the output projection by vocabulary columns;
the logits stay sharded over the vocabulary and the loss is computed with `loss_parallel`,
so no rank ever holds full-vocabulary logits.

With `sp=true` the activations between those regions (the norms and the residual stream) are
split along the sequence instead of replicated: the all-reduce after each row-parallel
matrix becomes a reduce-scatter, and an all-gather precedes each column-parallel region
(sequence_parallel.py, which keeps only the shard of the gathered input for backward and
gathers it again there, as Megatron does). The communicated bytes are the same in forward,
one all-gather more per region in backward; activation memory of the norm regions and of the
matrices' saved inputs is divided by tp.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from phalanx.parallel.latent_tp import latent_plan, reduce_rope_key_grad
from phalanx.parallel.sequence_parallel import gather_sequence
from phalanx.plan import Plan


def block_plan(sp: bool) -> dict[str, object]:
    """Module name inside a transformer block -> parallel style."""
    # Between regions the residual stream is sequence-sharded (sp) or replicated.
    between = Shard(1) if sp else Replicate()
    plan: dict[str, object] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
        "feed_forward.w3": ColwiseParallel(),
    }
    if sp:
        # The sequence is gathered before attention and the MLP by `gather_sequence` (apply_tp),
        # which, unlike PrepareModuleInput, keeps only the shard for backward.
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
    return plan


GATHERED_MODULES = ("attention", "feed_forward")
"""Block parts that take the whole sequence under sp (their first matrices are column-parallel);
at the root, the output projection does too."""


def root_plan(sp: bool, *, has_embedding: bool, has_output: bool) -> dict[str, object]:
    """Module name at the model root -> parallel style (for the parts this stage holds)."""
    between = Shard(1) if sp else Replicate()
    plan: dict[str, object] = {}
    if has_embedding:
        # Vocabulary-parallel embedding: each rank looks up the ids in its vocabulary rows
        # (zeros elsewhere) and the partial results are summed (or reduce-scattered with sp).
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if has_output:
        if sp:
            plan["norm"] = SequenceParallel()
        # Logits stay a DTensor sharded over the vocabulary, for `loss_parallel`. Under sp the
        # input arrives gathered by `gather_sequence` (apply_tp), so replicated.
        plan["output"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
    return plan


def apply_tp(model: nn.Module, tp_mesh, *, sp: bool) -> nn.Module:
    """Shard `model` (a Transformer, possibly a pipeline stage with parts deleted) over tp_mesh.

    Runs on the meta device: parameters become meta DTensors and are filled later by
    `phalanx.parallel.materialize`, which draws each full value and keeps this rank's shard.
    """
    for block in model.layers.values():
        # Only the entries whose module exists: a GeLU MLP has no gate matrix w3, latent
        # attention no wk/wv (its own split: parallel/latent_tp.py).
        plan = {name: style for name, style in {**block_plan(sp), **latent_plan()}.items() if _has_module(block, name)}
        if hasattr(block.attention, "wkv_a"):
            reduce_rope_key_grad(block.attention, tp_mesh)
        if hasattr(block.feed_forward, "experts"):
            # MoE block: tp splits attention only. Every tp rank holds its ep share of whole
            # experts and routes the (replicated) tokens itself; experts are split by ep, and
            # with ep_over_tp each tp rank sends only its 1/tp of the rows (expert_fold.py).
            plan = {name: style for name, style in plan.items() if not name.startswith("feed_forward.")}
        parallelize_module(block, tp_mesh, plan)
        if sp:
            for name in GATHERED_MODULES:
                gather_sequence(block.get_submodule(name), tp_mesh)
    plan = root_plan(sp, has_embedding=model.tok_embeddings is not None, has_output=model.output is not None)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if sp and model.output is not None:
        gather_sequence(model.output, tp_mesh)
    model.tie_weights()  # both now vocabulary-row-sharded DTensors: one parameter again
    return model


def _has_module(root: nn.Module, name: str) -> bool:
    try:
        root.get_submodule(name)
    except AttributeError:
        return False
    return True


def loss_context(plan: Plan):
    """The context in which forward, loss and backward run: vocabulary-parallel cross-entropy
    when the logits are sharded over tp, nothing otherwise."""
    if plan.tp > 1:

        return loss_parallel()
    return contextlib.nullcontext()


