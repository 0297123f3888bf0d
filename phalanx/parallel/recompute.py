"""Activation checkpointing of transformer blocks (`recompute=selective|full`).

- full: a block keeps only its input; backward reruns the whole block. Activation memory
  per block drops to one (batch, seq, dim) tensor, for about one extra forward of compute.
- selective: Korthikanti et al.'s selective recomputation: only the attention core
  (`AttentionCore`: the scores, softmax and the product with v) is recomputed in backward;
  everything else keeps its activations. Without flash attention the core's saved tensors
  grow with seq^2 (the softmax and its inputs); recomputing them costs the core's FLOPs, a few
  percent of the layer's. With flash attention (torch's CPU and CUDA kernels) the core saves
  only q, k, v (which the checkpoint keeps as its inputs), its output (which the output
  projection keeps as its input) and a log-sum-exp per row, so selective saves little there:
  the planner then never proposes it (planner/search.py).

Applied after tensor parallelism (it wraps the already-parallel block or core) and before
FSDP (so FSDP's per-block unit sees the wrapped block and gathers weights again for a full
recompute). Recomputation replays the same ops on the same inputs, so losses are bit-identical.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_recompute(model: nn.Module, mode: str, layers: int = 0) -> nn.Module:
    """Wrap the blocks of `model` (a Transformer or pipeline chunk) for recomputation: every
    block, or with `layers` > 0 only its first `layers` (the rest keep their activations:
    less memory saved, less recomputed, as Megatron's `--recompute-num-layers`)."""
    if mode == "none":
        return model

    blocks = list(model.layers.items())
    for key, block in blocks[:layers] if layers else blocks:
        # The wrapper's default (non-reentrant) checkpoint is the variant that supports DTensors.
        # The model has no dropout, so no RNG state needs preserving.
        if mode == "full":
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
        elif getattr(block.attention, "core", None) is None:
            raise ValueError(f"recompute=selective needs an attention core module; {type(block.attention).__name__} has none")
        else:  # the core has no parameters: wrapping it changes no state_dict key
            block.attention.core = checkpoint_wrapper(block.attention.core, preserve_rng_state=False)
    return model
