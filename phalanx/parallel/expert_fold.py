"""MoE parallel folding: tp ranks split an MoE layer's expert work instead of repeating it.

Under tp (without sp) an MoE block's input is replicated on the tp ranks, and so are the
router's decisions: every tp rank holds the same rows (token-expert assignments, sorted by
expert). Without folding each tp rank dispatched and computed all of them, tp times the
work. With `ep_over_tp=true` (`Plan.ep_over_tp`):

  1. each tp rank keeps its contiguous 1/tp of the sorted rows (`scatter_to_tp`), still sorted
     by expert, with counts cut to that range on the device (no host read);
  2. the rows travel by all-to-all over an ep group drawn from the stage's dp x tp ranks
     (`ParallelMesh.fold_dp_tp`), so ep may reach dp x tp and each rank holds fewer experts;
  3. the results are all-gathered back over tp (`gather_from_tp`), so the router weighting,
     the combine into tokens and everything after it run on replicated tensors as before.

Autograd: the two moves are each other's transpose. Downstream of the gather every tp rank
computes the same full gradient (the residual stream is replicated), so the gather's backward
keeps this rank's slice; the slice's backward all-gathers the slices' gradients, so every tp
rank gets the full gradient of the replicated rows, as the replicated computation upstream
expects. The router and aux losses see all assignments on every tp rank, exactly as without
folding; each assignment is computed by exactly one rank, so the expert-gradient rule of
`phalanx.parallel.expert` (sum over "edp", divide by dp) holds with edp = dp x tp / ep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TpFold:
    """The tp group whose ranks share one dp rank's rows, and this rank's place in it."""

    group: Any
    rank: int
    size: int

    def bounds(self, n: int) -> tuple[int, int]:
        """This rank's rows [lo, hi) of n: contiguous, sizes differing by at most one."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size


def _all_gather_rows(part: torch.Tensor, n: int, fold: TpFold) -> torch.Tensor:
    """The tp ranks' row ranges of an n-row tensor, concatenated in rank order: (n, ...).

    Ranges differ in length by at most one, so each is padded to the longest for the
    collective (all_gather needs equal shapes) and the padding is cut away after."""
    longest = -(-n // fold.size)
    padded = part.new_zeros((longest, *part.shape[1:]))
    padded[: part.shape[0]] = part
    pieces = [torch.empty_like(padded) for _ in range(fold.size)]
    dist.all_gather(pieces, padded.contiguous(), group=fold.group)
    lengths = [TpFold(None, r, fold.size).bounds(n) for r in range(fold.size)]
    return torch.cat([piece[: hi - lo] for piece, (lo, hi) in zip(pieces, lengths)])


class _ScatterToTp(torch.autograd.Function):
    """Forward: this rank's rows of a tp-replicated tensor. Backward: all-gather the slices'
    gradients, the full gradient of the replicated input on every tp rank."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, fold: TpFold) -> torch.Tensor:
        ctx.fold, ctx.n = fold, rows.shape[0]
        lo, hi = fold.bounds(rows.shape[0])
        return rows[lo:hi].clone()  # a fresh tensor: a view of the input would be tied to it

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_rows(grad, ctx.n, ctx.fold), None


class _GatherFromTp(torch.autograd.Function):
    """Forward: all-gather the tp ranks' slices into the replicated rows. Backward: this rank's
    slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, n: int, fold: TpFold) -> torch.Tensor:
        ctx.fold = fold
        return _all_gather_rows(part, n, fold)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo, hi = ctx.fold.bounds(grad.shape[0])
        return grad[lo:hi], None, None


def scatter_to_tp(rows: torch.Tensor, counts: torch.Tensor, fold: TpFold) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of rows sorted by expert, and the rows per expert in that slice.

    counts: (experts,) of all rows. The slice [lo, hi) holds, of expert e's rows
    [start_e, end_e), the overlap of the two ranges: computed on the device."""
    lo, hi = fold.bounds(rows.shape[0])
    ends = torch.cumsum(counts, 0)
    sliced = ends.clamp(lo, hi) - (ends - counts).clamp(lo, hi)  # (experts,)
    return _ScatterToTp.apply(rows, fold), sliced.to(counts.dtype)


def gather_from_tp(part: torch.Tensor, n: int, fold: TpFold) -> torch.Tensor:
    """The inverse of `scatter_to_tp`'s slice: (n, ...) rows, the same on every tp rank."""
    return _GatherFromTp.apply(part, n, fold)
