"""Moving expert slots to a new placement, weights and optimizer state, over an ep group.

After a rebalance (`phalanx.balance.rebalancer`) every rank knows the old and the new
placement (the same on all ranks), so every rank can work out, without asking, which rows it
sends to whom and which it receives: `copy_sources` names the old slot each new slot reads.
A changed slot whose expert was already on its rank is a local copy; the rest travel in one
`all_to_all_single` per dtype with uneven splits (gloo supports uneven splits there; it does
not support an uneven list `all_to_all`). If no slot reads from another rank, no collective
runs at all (every rank reaches that conclusion alike, so none waits for the others).

Tensors are stacked [local_slots, ...] like `GroupedExperts`' w1/w2/w3. Under FSDP they are
sharded over "edp" inside each slot, and each rank moves its slice of its slots
(`expert_slots.local_stack`; docs/expert_slots.md). AdamW's `exp_avg` and `exp_avg_sq` are per
element and move with their weights; its `step` is one count per parameter tensor, equal on
every rank (all ranks step together), so it stays.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from phalanx.balance.slot_copies import copy_sources
from phalanx.errors import UserError
from phalanx.parallel.expert_slots import local_stack

MOVING_STATE = ("exp_avg", "exp_avg_sq")
"""Optimizer state that is per element of a weight, so it moves with the weight's slot."""


def _exchange_plan(old, new, ep: int, rank: int):
    """(local copies (dst, src), send rows, send splits, receive slots in arrival order, receive splits).

    Local indices are rows of this rank's stacked tensors. A sender lists, per destination
    rank in order, the rows that destination's new slots read from it, by increasing new slot;
    so arrivals come by source rank, then increasing new slot.
    """
    old, new = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
    source = copy_sources(old, new, ep)
    per_rank = old.size // ep
    slot = np.arange(old.size)
    src_rank, dst_rank = source // per_rank, slot // per_rank
    mine_local = (dst_rank == rank) & (src_rank == rank)
    local = (slot[mine_local] - rank * per_rank, source[mine_local] - rank * per_rank)
    sending = (src_rank == rank) & (dst_rank != rank)
    send_rows = source[sending] - rank * per_rank
    send_splits = np.bincount(dst_rank[sending], minlength=ep)
    receiving = (dst_rank == rank) & (src_rank != rank)
    arrivals = slot[receiving][np.lexsort((slot[receiving], src_rank[receiving]))] - rank * per_rank
    recv_splits = np.bincount(src_rank[receiving], minlength=ep)
    remote_anywhere = bool((src_rank != dst_rank).any())
    return local, send_rows, send_splits, arrivals, recv_splits, remote_anywhere


def move_slots(tensors: list[torch.Tensor], old, new, group=None) -> list[torch.Tensor]:
    """New [local_slots, ...] tensors for the new placement from the old ones; every ep rank calls it.

    old, new: one layer's slot -> expert rows (S,) (a `SlotPlacement.slot_expert` or a
    balancer phy2log row), the same on every rank. Slots whose expert is unchanged keep their
    rows; moved slots take a copy of an old replica (replicas are identical, so any will do).
    """
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = len(old) // ep
    for tensor in tensors:
        if tensor.shape[0] != per_rank:
            raise UserError(f"a slot tensor has {tensor.shape[0]} rows, but this rank holds {per_rank} slots ({len(old)} over ep={ep})")
    local, send_rows, send_splits, arrivals, recv_splits, remote_anywhere = _exchange_plan(old, new, ep, rank)
    outputs = [tensor.clone() for tensor in tensors]  # unchanged slots keep their rows
    as_index = lambda a, t: torch.as_tensor(a, dtype=torch.long, device=t.device)  # noqa: E731
    for out, tensor in zip(outputs, tensors):
        out[as_index(local[0], out)] = tensor[as_index(local[1], tensor)]  # reads the old tensor, never the new
    if not remote_anywhere:
        return outputs
    # One exchange per dtype: a slot's tensors of that dtype side by side as one row.
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(index)
    for indices in by_dtype.values():
        flat = [tensors[i].reshape(per_rank, -1) for i in indices]  # (local_slots, numel of one slot)
        widths = [f.shape[1] for f in flat]
        rows = torch.cat(flat, dim=1)[as_index(send_rows, flat[0])]  # (rows sent, total width)
        arrived = rows.new_empty((int(recv_splits.sum()), rows.shape[1]))
        dist.all_to_all_single(arrived, rows.contiguous(), output_split_sizes=recv_splits.tolist(),
                               input_split_sizes=send_splits.tolist(), group=group)
        for i, part in zip(indices, torch.split(arrived, widths, dim=1)):
            outputs[i].view(per_rank, -1)[as_index(arrivals, part)] = part
    return outputs


def move_expert_slots(params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None, old, new, group=None) -> None:
    """Move stacked expert weights and their per-element optimizer state in place.

    In place (`copy_`), so the parameters and state tensors stay the objects the optimizer and
    any hooks hold. Call between optimizer steps, after `zero_grad`: gradients do not move.
    """
    tensors = []
    with torch.no_grad():
        for param in params:
            # Under FSDP: this edp rank's slice of every local slot (`local_stack`), the same
            # slice on every ep rank, so moving the slices moves the slots; AdamW's moments are
            # DTensors sharded like their parameter.
            tensors.append(local_stack(param.detach()))
            state = optimizer.state.get(param, {}) if optimizer is not None else {}
            for key in MOVING_STATE:
                if isinstance(state.get(key), torch.Tensor) and state[key].shape == param.shape:
                    tensors.append(local_stack(state[key]))
        for target, moved in zip(tensors, move_slots(tensors, old, new, group)):
            target.copy_(moved)


def slot_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of one slot's weights and moving optimizer state: what a moved slot sends
    (`ExpertRebalancer(slot_bytes=...)`). Counts the state the optimizer holds now: before
    its first step AdamW has none yet."""
    total = 0
    for param in params:
        per_slot = math.prod(param.shape[1:])  # the whole slot (the global shape under FSDP)
        total += per_slot * param.element_size()
        state = optimizer.state.get(param, {}) if optimizer is not None else {}
        for key in MOVING_STATE:
            if isinstance(state.get(key), torch.Tensor) and state[key].shape == param.shape:
                total += per_slot * state[key].element_size()
    return total
