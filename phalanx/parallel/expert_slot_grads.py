"""Replicas stay identical: a replicated expert's gradient is the sum over its replica slots.

An expert's gradient in the model without replicas sums the contributions of every token
routed to it. With replicas, each replica slot saw only the tokens routed to it; summing the
slots' gradients over the ep group gives the unreplicated gradient, and writing that sum back
to every replica makes every replica apply the same update (same weights, same AdamW moments,
so they stay bit-identical). This is a sum over the ep group only; the reduction over "edp"
and the division by dp (`phalanx.parallel.expert`) are sums too and commute with it, so it may
run before or after them, once per optimizer step (after the last micro-batch). Under FSDP the
experts are sharded over edp within each slot, and the sum runs on the gradient slices FSDP's
reduce-scatter left (`local_stack`), before clipping and the optimizer.

Cost. One `all_reduce` per dtype of a dense (replicated experts, numel of one expert) buffer:
rows only for experts with more than one replica (none: no collective), every rank taking
part. That moves about 2 x R x expert size per rank (ring), R = replicated experts, where a
reduction among each expert's holders only would move about 2 x (its slots on this rank) x
expert size, but would need one process group per holder set, and those sets change at every
rebalance. With few hot experts R is small; at R close to E it costs a full all-reduce of
the layer's experts (what data parallelism pays for a dense layer).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import UserError
from phalanx.parallel.expert_slots import SlotPlacement, local_stack


def _replica_rows(placement: SlotPlacement, rank: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(local slot indices of replicated experts, their row in the dense buffer, buffer rows)."""
    replicated = np.flatnonzero(placement.replicas() > 1)  # (R,) experts, increasing
    row_of_expert = np.full(placement.n_experts, -1)
    row_of_expert[replicated] = np.arange(replicated.size)
    held = np.asarray(placement.slot_expert)[list(placement.local_slots(rank))]  # (local_slots,)
    rows = row_of_expert[held]
    local = np.flatnonzero(rows >= 0)
    return local, rows[local], replicated.size


@torch.no_grad()
def sum_replica_grads(grads: list[torch.Tensor], placement: SlotPlacement, group=None) -> None:
    """Replace, in place, each local slot's gradient by the sum over its expert's replica slots.

    grads: stacked [local_slots, ...] (w1, w2, w3 gradients of one layer); every ep rank calls
    this with the same placement. Slots of unreplicated experts are left untouched.
    """
    rank = dist.get_rank(group)
    if dist.get_world_size(group) != placement.ep:
        raise UserError(f"the placement is over ep={placement.ep} ranks, the group has {dist.get_world_size(group)}")
    local, rows, n_rows = _replica_rows(placement, rank)
    if n_rows == 0:
        return  # no replica anywhere: the same conclusion on every rank, so no one waits
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        if grad.shape[0] != placement.slots_per_rank:
            raise UserError(f"a slot gradient has {grad.shape[0]} rows, but this rank holds {placement.slots_per_rank} slots")
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        flat = [g.reshape(g.shape[0], -1) for g in same_dtype]  # (local_slots, numel of one slot)
        widths = [f.shape[1] for f in flat]
        device = flat[0].device
        local_t = torch.as_tensor(local, dtype=torch.long, device=device)
        rows_t = torch.as_tensor(rows, dtype=torch.long, device=device)
        buffer = torch.zeros(n_rows, sum(widths), dtype=flat[0].dtype, device=device)  # (R, width)
        # A rank holds at most one slot of an expert (SlotPlacement's rule), so rows are distinct.
        buffer[rows_t] = torch.cat(flat, dim=1)[local_t]
        dist.all_reduce(buffer, group=group)
        for g, part in zip(same_dtype, torch.split(buffer[rows_t], widths, dim=1)):
            g.view(g.shape[0], -1)[local_t] = part  # view: g is written in place


def sum_replica_param_grads(params: list[nn.Parameter], placement: SlotPlacement, group=None) -> None:
    """`sum_replica_grads` on parameters' `.grad` (a parameter without one counts as zero)."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    # Under FSDP each gradient is this edp rank's reduce-scattered slice of every local slot
    # (already summed over edp); the same slice on every ep rank, so the sum runs on it as is.
    sum_replica_grads([local_stack(param.grad) for param in params], placement, group)


def counted_once(placement: SlotPlacement, rank: int) -> np.ndarray:
    """(local_slots,) True where this slot is its expert's lowest slot.

    After `sum_replica_grads` every replica holds the expert's whole gradient; the gradient
    norm for clipping must count each expert once, over these slots only (else a replicated
    expert would weigh as many times as it has replicas).
    """
    held = np.asarray(placement.slot_expert)
    first = np.full(placement.n_experts, placement.slots)
    np.minimum.at(first, held, np.arange(placement.slots))
    local = np.array(list(placement.local_slots(rank)))
    return first[held[local]] == local
