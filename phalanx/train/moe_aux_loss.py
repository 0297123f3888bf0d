"""The routers' auxiliary losses (balance and z losses), once per micro-batch.

* `aux_loss(model)`: the MoE layers' losses from the last forward, to add to the loss.
* `aux_losses_in_backward(model)`: under pipeline parallelism, where the schedule computes the
  loss, put those losses' gradients into the backward through each MoE layer's output instead.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.model.moe import MoE, in_recompute
from phalanx.train.moe_stats import moe_layers


def aux_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum of the auxiliary losses the MoE layers left from the last forward (0 if none)."""
    terms = [moe.aux_loss for _, moe in moe_layers(model) if moe.aux_loss is not None]
    return sum(terms) if terms else 0.0


class _AddAuxGradient(torch.autograd.Function):
    """Identity on a layer's output that, in backward, also seeds its auxiliary loss with
    gradient 1, as if that loss had been added to the loss being back-propagated.

    Under pipeline parallelism the schedule back-propagates the last stage's loss only; an
    auxiliary loss made on an earlier stage is in no graph that reaches it. Riding on the
    layer's output puts its gradient in the backward the stage runs anyway, at the point where
    that output's gradient arrives. (Megatron-Core's `MoEAuxLossAutoScaler` uses the same idea.)
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        # Shape, dtype and device only, not a saved tensor: activation checkpointing compares
        # the number of saved tensors with the recomputation, which skips this function.
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_like
        return grad, torch.ones(shape, dtype=dtype, device=device)


def _aux_into_backward(moe: MoE, args, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: attach the auxiliary loss the layer just made to its output."""
    if not moe.training or moe.aux_loss is None or in_recompute():
        return output  # recompute: the first forward already attached this micro-batch's loss
    aux, moe.aux_loss = moe.aux_loss, None  # consumed here: nobody else may add it again
    return _AddAuxGradient.apply(output, aux)


def aux_losses_in_backward(model: nn.Module) -> None:
    """Make each MoE layer's auxiliary losses part of the backward through its own output,
    for pipeline stages, where the trainer cannot add them to the loss it back-propagates.

    The gradient seeded is 1 per micro-batch's aux loss; the schedule then divides every
    gradient by the number of micro-batches (`scale_grads`), exactly as the non-pipelined
    loop back-propagates `(loss + aux) / microbatches` per micro-batch.
    """
    for _, moe in moe_layers(model):
        if moe.aux_loss_coef or moe.z_loss_coef:
            moe.register_forward_hook(_aux_into_backward)
