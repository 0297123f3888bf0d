"""Dispatch and combine: rows travel to the ep rank that holds their expert, and back.

Both are `all_to_all_single` with uneven splits, after a first all-to-all of the per-expert
counts so each rank knows how many rows it will receive. The moves are autograd functions
whose backward is the reverse all-to-all, so gradients flow back to the senders.

Host synchronizations. The split sizes must be Python ints (all_to_all_single takes lists),
so reading them is the one device-to-host copy a dispatch needs: every number the host uses
(rows sent to and received from each rank, rows per local expert) comes back in that one
`tolist()`, and the plan keeps them for combine and for both backward all-to-alls, which
thus add no synchronization (`tests/test_expert_host_syncs.py` counts them).

Order on arrival. Rows arrive source-major: one block per (source rank, local expert).
`dispatch` regroups them by local expert (a gather, undone by `combine`), as the grouped
kernel needs one contiguous group per expert. The per-expert loop does not: it can run each
block where it lies (`plan_dispatch`, `send_rows`, `return_rows`; `ShardedExperts` does on
CPU), sparing both permutations of every received row, forward and backward.

Waits. Each all-to-all's host time is added up (`take_dispatch_waits`): on gloo the host blocks
until every rank's rows arrived, so that is this rank's time waiting for slower peers (and for
the transfer), which the trainer's rank clock counts as waiting, not computing
(phalanx/train/rank_clock.py). With NCCL the call returns once queued: near zero, not the wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_waited = [0.0]
"""Host seconds in the dispatch's all-to-alls since the last `take_dispatch_waits` (this process's)."""


def take_dispatch_waits() -> float:
    """The seconds spent in the dispatch's all-to-alls since the last call (then zero again)."""
    seconds, _waited[0] = _waited[0], 0.0
    return seconds


def _all_to_all(out: torch.Tensor, x: torch.Tensor, **kwargs) -> None:
    began = time.perf_counter()
    dist.all_to_all_single(out, x, **kwargs)
    _waited[0] += time.perf_counter() - began


class _AllToAll(torch.autograd.Function):
    """Rows of x go to ranks by `send` splits, arrive by `recv` splits; backward reverses it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        _all_to_all(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_in = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        _all_to_all(
            grad_in, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group
        )
        return grad_in, None, None, None


@dataclass
class DispatchPlan:
    """What the row exchange needs, both ways: split sizes on the host, counts on the device."""

    send: list[int]
    """Rows this rank sent to each ep rank."""
    recv: list[int]
    """Rows this rank received from each ep rank."""
    block_counts: list[int]
    """Rows received per (source rank, local expert), source-major, on the host: arrivals come
    as ep * n_local contiguous blocks, block b from rank b // n_local for local expert
    b % n_local."""
    recv_counts: torch.Tensor
    """(ep, n_local) the same counts on the device."""
    regroup: torch.Tensor | None = None
    """(received rows,) positions in arrival order listed by local expert, once `dispatch`
    has regrouped the arrivals (None while they are still source-major)."""

    @property
    def local_counts(self) -> list[int]:
        """Rows received for each local expert (from all ranks), on the host."""
        n_local = self.recv_counts.shape[1]
        return [sum(self.block_counts[expert::n_local]) for expert in range(n_local)]

    @property
    def block_experts(self) -> list[int]:
        """The local expert of each arrival block."""
        n_local = self.recv_counts.shape[1]
        return [block % n_local for block in range(len(self.block_counts))]


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


def plan_dispatch(counts: torch.Tensor, group) -> DispatchPlan:
    """Exchange the per-expert counts (counts: (n_experts,) rows this rank sends per global
    expert) and read every split size the host needs, in one synchronization."""
    ep = dist.get_world_size(group)
    n_local = counts.numel() // ep
    # recv_counts[s, e] = rows rank s will send for my local expert e.
    recv_counts = torch.empty_like(counts)
    _all_to_all(recv_counts, counts.contiguous(), group=group)
    recv_counts = recv_counts.view(ep, n_local)  # (source rank, local expert)
    # The one host read: rows sent to each rank, and received per (source rank, local expert).
    host = torch.cat([counts.view(ep, n_local).sum(dim=1), recv_counts.reshape(-1)]).tolist()
    send, block_counts = host[:ep], host[ep:]
    recv = [sum(block_counts[rank * n_local : (rank + 1) * n_local]) for rank in range(ep)]
    return DispatchPlan(send=send, recv=recv, block_counts=block_counts, recv_counts=recv_counts)


def send_rows(rows: torch.Tensor, plan: DispatchPlan, group) -> torch.Tensor:
    """rows (sorted by global expert) to the ranks holding their experts -> the arrivals,
    source-major (`DispatchPlan.block_counts` lays out their blocks)."""
    return _AllToAll.apply(rows, plan.send, plan.recv, group)


def return_rows(out: torch.Tensor, plan: DispatchPlan, group) -> torch.Tensor:
    """Inverse of `send_rows`: results (in arrival order) go back to their senders."""
    return _AllToAll.apply(out, plan.recv, plan.send, group)


def dispatch(rows: torch.Tensor, counts: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Send rows (sorted by global expert, counts per expert) to the ranks holding the experts.

    Returns the rows this rank's experts must process, sorted by local expert, the count per
    local expert, and the plan that `combine` uses to return the results.
    """
    plan = plan_dispatch(counts, group)
    arrived = send_rows(rows, plan, group)  # (received, dim), source-major
    return (*regroup_by_expert(arrived, plan), plan)


def regroup_by_expert(arrived: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Source-major arrivals -> the same rows sorted by local expert, and the count per local
    expert; records the permutation in the plan, for `combine` to undo."""
    plan.regroup = _expert_major(plan.recv_counts, arrived.shape[0])
    return arrived[plan.regroup], plan.recv_counts.sum(dim=0)


def combine(out: torch.Tensor, plan: DispatchPlan, group) -> torch.Tensor:
    """Inverse of `dispatch`: results go back to their senders, in the order they were sent."""
    if plan.regroup is not None:
        out = torch.empty_like(out).index_copy(0, plan.regroup, out)  # undo the regroup
    return return_rows(out, plan, group)
