"""Context parallelism's communication schedule: when and how the keys and values of the
whole sequence reach each cp rank, and their gradients come back.

Each attention layer all-gathers its keys and values over the cp group (one collective of
both, side by side on the channels) and puts them in position order for the blocks of
context_parallel_layout.py. With grouped-query attention the keys and values are a fraction of
the activations (8 KV heads of 32 for Llama 3: half a hidden state per token, where tp
all-reduces the whole hidden state twice per layer), which is why Llama 3 chose the gather
over a ring (docs/layout.md says more). The gather's backward sums each rank's key/value
gradients over the cp ranks whose queries used them and hands each its own part: a
reduce-scatter.

Ordinary attention: the gather is issued before the attention starts, and the attention
computes the blocks that need only this rank's own keys (each chunk's causal diagonal) while
it travels (`PendingGather`); in backward the key/value gradients of the other blocks are
reduce-scattered while those of the diagonal blocks are computed (`PendingReduceScatter`);
both inside the custom op `phalanx::cp_attention` (context_parallel_attention.py), which
`--compile` keeps whole in the block's graph.

The ring (the plan's cp_ring=true, context_parallel_ring.py): instead of one collective, cp - 1
point-to-point passes to the next cp rank (`PendingPass`), each issued before a step of
attention and waited for after it; in backward the partial sums of the key/value gradients go
around the same way.

Latent attention decompresses its keys per head after the gather (so that only the latents
travel), so its gather comes before its attention, not overlapped: `gather_keys_values`,
torch's functional all-gather, whose reduce-scatter autograd registers and dynamo traces
into a compiled block's forward and backward graphs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from phalanx.parallel.context_parallel_layout import position_order, rank_order

_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
"""torch's traceable all-gather on dim 0 (a functional collective) whose backward is a sum
reduce-scatter: its torch 2.13 name, else the older one (torch 2.11, 2.12)."""

_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""The process-group calls into a tensor: torch 2.13's names (the older ones warn there), else
the older ones (torch 2.11, 2.12), same arguments."""


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


class PendingGather:
    """An all-gather of this rank's k, v (batch, kv_heads, local, c_k or c_v) over the cp
    group, issued on construction; `wait` returns the whole sequence's in position order."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, group, cp: int):
        self.cp = cp
        local = torch.cat([k, v], dim=-1).movedim(-2, 0).contiguous()  # (local, batch, kv_heads, c_k + c_v)
        self.buffer = local.new_empty((cp * local.shape[0], *local.shape[1:]))  # (seq, ...) in rank order
        self.work = _gather_into(self.buffer, local, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        """-> (batch, kv_heads, seq, c_k + c_v): keys and values side by side, in position order."""
        with torch.profiler.record_function("cp: wait for the key/value gather"):
            self.work.wait()
        return position_order(self.buffer.movedim(0, -2), self.cp)


class PendingReduceScatter:
    """The sum over the cp ranks of the gradients of the whole sequence's k, v (position
    order), each rank receiving those of its own positions; issued on construction."""

    def __init__(self, dk: torch.Tensor, dv: torch.Tensor, group, cp: int):
        self.width = dk.shape[-1]
        whole = rank_order(torch.cat([dk, dv], dim=-1), cp).movedim(-2, 0).contiguous()  # (seq, batch, kv_heads, c)
        self.buffer = whole.new_empty((whole.shape[0] // cp, *whole.shape[1:]))
        self.work = _reduce_scatter_into(self.buffer, whole, group=group, async_op=True)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.profiler.record_function("cp: wait for the gradient reduce-scatter"):
            self.work.wait()
        both = self.buffer.movedim(0, -2)  # (batch, kv_heads, local, c_k + c_v)
        return both[..., :self.width], both[..., self.width:]


class PendingPass:
    """One step of a ring over the cp group: `t` sent to the next cp rank while the same-shaped
    tensor of the rank before is received, both issued on construction (point-to-point, no
    collective: each rank talks to its two neighbours only); `wait` returns what came in."""

    def __init__(self, t: torch.Tensor, group, what: str):
        me, cp = dist.get_rank(group), dist.get_world_size(group)
        self.what = what
        self.sent = t.contiguous()  # held until the pass is waited for: a temporary must outlive its send
        self.buffer = torch.empty_like(self.sent)
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, self.sent, dist.get_global_rank(group, (me + 1) % cp), group),
            dist.P2POp(dist.irecv, self.buffer, dist.get_global_rank(group, (me - 1) % cp), group)])

    def wait(self) -> torch.Tensor:
        with torch.profiler.record_function(f"cp ring: wait for the {self.what}"):
            for work in self.works:
                work.wait()
        return self.buffer
