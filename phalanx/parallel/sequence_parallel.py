"""Sequence parallelism's all-gather before attention and the MLP, kept as shards for backward.

Under `sp=true` the residual stream and the norms hold 1/tp of the sequence; attention and the
MLP need all of it, so their input is all-gathered first. Their column-parallel matrices (wq,
wk, wv; w1, w3) save that gathered input for their weight gradients: left alone, autograd
keeps the whole (batch, seq, dim) tensor on every rank. Megatron keeps only the rank's shard
and all-gathers it again in backward (Korthikanti et al. section 4.2.2), which is what this
does: `gather_sequence` (a forward pre-hook in place of `PrepareModuleInput`) all-gathers the
shard and, while the module runs, installs saved-tensor hooks that store the shard instead of
any saved tensor that views the gathered storage; the first unpack in backward gathers it again
(once for all the matrices that saved it) and each gets its own view back.

Other saved-tensor hooks already active (activation checkpointing's, or a measurement's) are
chained: the shard, not the gathered tensor, goes through them, so a checkpointed block keeps
or recomputes the shard as it would any tensor. That needs the hooks on top of autograd's
stack, read with `torch._C._autograd._top_saved_tensors_default_hooks(ignore_is_tracing)`
(private; in torch since 2.8, so in every version phalanx supports, 2.11 on;
`tests/test_activation_cuts.py` runs it beneath activation checkpointing's hooks).

The gather is exact, so forward and backward compute the same numbers as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclass
class _Shard:
    """The gathered input of one call, as its shard; gathered again on first use in backward."""
    shard: torch.Tensor
    """This rank's (batch, seq / tp, dim) local shard (or what an outer hook packed it into)."""
    outer_unpack: object
    mesh: object
    pending: int = 0
    gathered: torch.Tensor | None = field(default=None, repr=False)

    def full(self) -> torch.Tensor:
        if self.gathered is None:
            shard = self.outer_unpack(self.shard) if self.outer_unpack is not None else self.shard
            self.gathered = _all_gather(shard, self.mesh)
        tensor = self.gathered
        self.pending -= 1
        if self.pending <= 0:  # every saver has it: drop the gathered copy
            self.gathered = None
        return tensor


@dataclass(frozen=True)
class _View:
    """Where one saved tensor lies in the gathered storage, and its DTensor wrapping, if any."""
    source: _Shard
    shape: tuple
    stride: tuple
    offset: int
    placements: tuple | None


def _all_gather(shard: torch.Tensor, mesh) -> torch.Tensor:
    """(batch, seq / tp, dim) local shard -> (batch, seq, dim) on every rank of `mesh`."""
    return DTensor.from_local(shard, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding t's data: a DTensor's local tensor, itself perhaps the
    not-yet-waited result of a collective (whose own storage cannot be read)."""
    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


class _SavedAsShard:
    """Saved-tensor hooks for one module call (see the module docstring)."""
    def __init__(self, shard: torch.Tensor, gathered: torch.Tensor, mesh):
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.outer_pack, outer_unpack = top if top is not None else (None, None)
        packed = self.outer_pack(shard) if self.outer_pack is not None else shard
        self.source = _Shard(packed, outer_unpack, mesh)
        self.storage = _local(gathered).untyped_storage().data_ptr()
        self.outer_unpack = outer_unpack

    def pack(self, t: torch.Tensor):
        local = _local(t)
        if local.untyped_storage().data_ptr() != self.storage:
            return ("as is", self.outer_pack(t) if self.outer_pack is not None else t)
        self.source.pending += 1
        placements = tuple(t.placements) if hasattr(t, "placements") else None  # a DTensor's
        return ("shard", _View(self.source, tuple(local.shape), local.stride(), local.storage_offset(), placements))

    def unpack(self, packed):
        kind, value = packed
        if kind == "as is":
            return self.outer_unpack(value) if self.outer_unpack is not None else value
        full = value.source.full()
        local = full.as_strided(value.shape, value.stride, value.offset)
        if value.placements is None:
            return local

        return DTensor.from_local(local, value.source.mesh, value.placements, run_check=False)


def gather_sequence(module: nn.Module, mesh) -> None:
    """Make `module` (a block's attention or MLP, or the output projection) take the
    sequence-sharded residual stream: all-gather it before forward, and keep only the shard
    for backward (see above)."""
    open_contexts: list = []  # the saved-tensor hooks of the call in flight

    def before(mod, args):
        x, *rest = args
        if not isinstance(x, DTensor):  # a plain local shard
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        if tuple(x.placements) != (Shard(1),):
            raise ValueError(f"sequence parallelism expects the input sharded on the sequence, got {x.placements}")
        # This gather keeps its autograd: its backward reduce-scatters the input's gradient.
        full = x.redistribute(mesh, [Replicate()]).to_local()  # (batch, seq, dim)
        context = None
        if torch.is_grad_enabled():  # nothing is saved otherwise (evaluation, generation)
            hooks = _SavedAsShard(x.to_local().detach(), full, mesh)
            context = torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)
            context.__enter__()
        open_contexts.append(context)
        return (full, *rest)

    def after(mod, args, output):
        context = open_contexts.pop() if open_contexts else None  # none left only if `before` failed
        if context is not None:
            context.__exit__(None, None, None)

    module.register_forward_pre_hook(before, prepend=True)  # before a ColwiseParallel's input hook
    module.register_forward_hook(after, always_call=True)
