"""Activation checkpointing of whole transformer blocks (`recompute=selective|full`).

- full: a block keeps only its input; backward reruns the whole block. Activation memory
  per block drops to one (batch, seq, dim) tensor, for about one extra forward of compute.
- selective: a block keeps the outputs of its matrix products and attention (the expensive
  ops) and recomputes only the cheap elementwise ones (norms, rotary, SiLU, products):
  less memory saved than full, but almost no extra FLOPs.

Applied after tensor parallelism (it wraps the already-parallel block) and before FSDP (so
FSDP's per-block unit sees the wrapped block and gathers weights again for the recompute).
Recomputation replays the same ops on the same inputs, so losses are bit-identical.
"""

from __future__ import annotations

import torch
from torch import nn

# Outputs worth keeping: the compute-bound ops. Everything else is recomputed in backward.
_SAVE = {
    getattr(torch.ops.aten, name).default
    for name in (
        "mm", "addmm", "bmm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
}


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


def apply_recompute(model: nn.Module, mode: str, layers: int = 0) -> nn.Module:
    """Wrap the blocks of `model` (a Transformer or pipeline chunk) for recomputation: every
    block, or with `layers` > 0 only its first `layers` (the rest keep their activations:
    less memory saved, less recomputed, as Megatron's `--recompute-num-layers`)."""
    if mode == "none":
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    extra = {"context_fn": _selective_context} if mode == "selective" else {}
    blocks = list(model.layers.items())
    for key, block in blocks[:layers] if layers else blocks:
        # The wrapper's default (non-reentrant) checkpoint is the variant that supports DTensors
        # and selective policies. The model has no dropout, so no RNG state needs preserving.
        model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False, **extra)
    return model
