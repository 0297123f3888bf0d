"""Dispatch and combine: rows travel to the ep rank that holds their expert, and back.

Both are `all_to_all_single` with uneven splits, after a first all-to-all of the per-expert
counts so each rank knows how many rows it will receive. The moves are autograd functions
whose backward is the reverse all-to-all, so gradients flow back to the senders.

Host synchronizations. The split sizes must be Python ints (all_to_all_single takes lists),
so reading them is the one device-to-host copy a dispatch needs: every number the host uses
(rows sent to and received from each rank, rows per local expert) comes back in that one
`tolist()`, and the plan keeps them for combine and for both backward all-to-alls, which
thus add no synchronization (`tests/test_expert_host_syncs.py` counts them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """Rows of x go to ranks by `send` splits, arrive by `recv` splits; backward reverses it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_in = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(
            grad_in, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group
        )
        return grad_in, None, None, None


@dataclass
class DispatchPlan:
    """What combine needs to send results back where their rows came from."""

    send: list[int]
    """Rows this rank sent to each ep rank."""
    recv: list[int]
    """Rows this rank received from each ep rank."""
    local_counts: list[int]
    """Rows received for each local expert (from all ranks), on the host."""
    regroup: torch.Tensor
    """(received rows,) positions in arrival order (by source rank), listed by local expert."""


def _expert_major(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """Row positions that reorder arrivals from (source rank, expert) to (expert, source rank).

    recv_counts: (ep, n_local) rows from each source rank for each local expert; arrivals are
    laid out source-major, each source's rows already sorted by expert. total: their sum,
    known on the host (passing it spares repeat_interleave a synchronization).
    """
    counts = recv_counts.reshape(-1)  # (ep * n_local,) in arrival order
    starts = torch.cumsum(counts, 0) - counts  # first arrival position of each block
    blocks = torch.arange(counts.numel(), device=counts.device).view(recv_counts.shape).t().reshape(-1)
    lengths, block_starts = counts[blocks], starts[blocks]  # in expert-major order
    offset_in_block = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths, output_size=total
    )
    return torch.repeat_interleave(block_starts, lengths, output_size=total) + offset_in_block


def dispatch(rows: torch.Tensor, counts: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Send rows (sorted by global expert, counts per expert) to the ranks holding the experts.

    Returns the rows this rank's experts must process, sorted by local expert, the count per
    local expert, and the plan that `combine` uses to return the results.
    """
    ep = dist.get_world_size(group)
    n_local = counts.numel() // ep
    # First the counts: recv_counts[s, e] = rows rank s will send for my local expert e.
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts.contiguous(), group=group)
    recv_counts = recv_counts.view(ep, n_local)  # (source rank, local expert)
    local_counts = recv_counts.sum(dim=0)  # (n_local,)
    # The one host read: rows sent to each rank, received from each rank, per local expert.
    host = torch.cat([counts.view(ep, n_local).sum(dim=1), recv_counts.sum(dim=1), local_counts]).tolist()
    send, recv, local_host = host[:ep], host[ep : 2 * ep], host[2 * ep :]
    arrived = _AllToAll.apply(rows, send, recv, group)  # (received, dim), source-major
    regroup = _expert_major(recv_counts, sum(recv))
    plan = DispatchPlan(send=send, recv=recv, local_counts=local_host, regroup=regroup)
    return arrived[regroup], local_counts, plan


def combine(out: torch.Tensor, plan: DispatchPlan, group) -> torch.Tensor:
    """Inverse of `dispatch`: results go back to their senders, in the order they were sent."""
    arrival_order = torch.empty_like(out).index_copy(0, plan.regroup, out)  # undo the regroup
    return _AllToAll.apply(arrival_order, plan.recv, plan.send, group)
