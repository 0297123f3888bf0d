"""Context parallelism's communication schedule: when and how the keys and values of the
whole sequence reach each cp rank.

Each attention layer all-gathers its keys and values over the cp group (one collective of
both, side by side on the channels) right before its attention, and puts them in position
order for the blocks of context_parallel_layout.py. With grouped-query attention the keys and
values are a fraction of the activations (8 KV heads of 32 for Llama 3: half a hidden state
per token, where tp all-reduces the whole hidden state twice per layer), which is why Llama 3
chose the gather over a ring (docs/layout.md says more).

The gather's backward sums each rank's key/value gradients over the cp ranks whose queries
used them and hands each its own part: a reduce-scatter. It is torch's functional all-gather,
whose reduce-scatter autograd registers and dynamo traces into a compiled block's forward and
backward graphs (`--compile`), where a process-group call in an autograd.Function of our own
would rely on dynamo rewriting it.
"""

from __future__ import annotations

import torch
from torch.distributed import _functional_collectives as funcol

from phalanx.parallel.context_parallel_layout import position_order

_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
"""torch's traceable all-gather on dim 0 (a functional collective) whose backward is a sum
reduce-scatter: its torch 2.13 name, else the older one (torch 2.11, 2.12)."""


def gather_over_cp(local: torch.Tensor, group) -> torch.Tensor:
    """(..., L, c) on each of cp ranks -> (..., cp * L, c), rank r's positions at r*L..(r+1)*L."""
    stacked = _all_gather(local.movedim(-2, 0).contiguous(), 0, group)  # (cp * L, ..., c)
    return stacked.movedim(0, -2)  # (..., cp * L, c)


def gather_keys_values(k: torch.Tensor, v: torch.Tensor, group, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's k, v (batch, kv_heads, local, c_k or c_v) -> the whole sequence's, in
    position order (batch, kv_heads, cp * local, c_k or c_v). One collective of both, side by
    side on the channels: latent attention's pair (its latent and its rotated shared key)
    differ in width."""
    width = k.shape[-1]
    both = position_order(gather_over_cp(torch.cat([k, v], dim=-1), group), cp)  # (batch, kv_heads, seq, c_k + c_v)
    return both[..., :width], both[..., width:]
