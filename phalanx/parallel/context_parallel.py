"""Context parallelism: each sequence split over the cp ranks, attention over the whole of it.

Each sequence is cut into 2 x cp equal chunks and cp rank i holds chunks i and 2cp-1-i
(`layout_rules.cp_chunks`; the data loader cuts them, `data/batches.chunk_positions`), so under the causal
mask every rank computes the same number of query-key pairs. Everything but attention works
per position and needs nothing from the other ranks; attention needs every earlier key. Here
each attention layer all-gathers its keys and values over the cp group (one collective of both)
and runs its queries against all of them under an explicit mask built from absolute positions:
a query chunk sees a key set of another length, where `is_causal=True`'s top-left alignment
would be wrong. With grouped-query attention the keys and values are a fraction of the
activations (8 KV heads of 32 for Llama 3: half a hidden state per token, where tp all-reduces
the whole hidden state twice per layer), which is why Llama 3 chose the gather over a ring
(docs/layout.md says more).

The gather's backward sums each rank's key/value gradients over the cp ranks whose queries
used them and hands each its own part: a reduce-scatter. The loss is each rank's mean over its
tokens; gradients are then averaged over the dp x cp ranks (every rank holds as many tokens),
which is the global batch's mean, as one process computes it.

The model stays single-device: its attention already asks an `AttentionCache` (kv_cache.py)
for the positions of its tokens and for the keys it sees. A forward pre-hook on each attention
layer hands it a `SequenceView` that answers from the cp group instead of a cache; generation
(which passes a real cache) is left alone. With `--doc-mask`, the same view also keeps
attention inside each document of a packed sequence (`document_ids`), with or without cp.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from phalanx.data.batches import chunk_positions

_documents: list[torch.Tensor | None] = [None]
"""The document id of every position of the micro-batch in flight, (batch, seq), set by
`document_ids` around its forward and backward (recomputation runs the forward again there).
A module variable, not a ContextVar: on CUDA, autograd runs the backward, and so the
recomputed forward, on its own device threads, which a ContextVar set here would not reach."""


@contextlib.contextmanager
def document_ids(ids: torch.Tensor | None):
    """Attention under `--doc-mask` keeps queries to keys of their own document: `ids`
    (batch, seq) numbers the documents of each whole (not chunked) sequence. Wrap the forward
    and the backward."""
    before, _documents[0] = _documents[0], ids
    try:
        yield
    finally:
        _documents[0] = before


def _gather_single(output: torch.Tensor, local: torch.Tensor, group) -> None:
    # all_gather_single is the new name (torch 2.13); all_gather_into_tensor the older one.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, local, group=group)


def _reduce_scatter_single(output: torch.Tensor, parts: torch.Tensor, group) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, parts, group=group)


class _GatherOverCp(torch.autograd.Function):
    """(..., L, c) on each of cp ranks -> (..., cp * L, c), rank r's positions at r*L..(r+1)*L;
    backward: the sum of every rank's gradient of this rank's part (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, cp: int) -> torch.Tensor:
        ctx.group, ctx.cp = group, cp
        local = local.contiguous()
        stacked = local.new_empty((cp * local.shape[0], *local.shape[1:]))  # ranks stacked on dim 0
        _gather_single(stacked, local, group)
        stacked = stacked.view(cp, *local.shape)  # (cp, ..., L, c)
        return stacked.movedim(0, -3).flatten(-3, -2)  # (..., cp * L, c)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        *lead, keys, channels = grad.shape
        parts = grad.reshape(*lead, ctx.cp, keys // ctx.cp, channels).movedim(-3, 0).contiguous()  # (cp, ..., L, c)
        mine = grad.new_empty(parts.shape[1:])
        _reduce_scatter_single(mine, parts.flatten(0, 1), ctx.group)
        return mine, None, None


class SequenceView:
    """What one forward's attention layers see of the whole sequence (the `AttentionCache`
    calls, kv_cache.py): this rank's positions, and every key of the sequence behind an
    explicit causal (and sliding-window, and document) mask."""

    def __init__(self, queries: torch.Tensor, keys: torch.Tensor, group, cp: int, documents: torch.Tensor | None):
        self.queries, self.keys, self.group, self.cp = queries, keys, group, cp
        self.documents = documents

    def positions(self, seq: int, device) -> torch.Tensor:
        return self.queries  # (seq,) absolute positions of this rank's two chunks

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.cp > 1:
            # One collective of both, side by side on the channels: latent attention's pair
            # (its latent and its rotated shared key) differ in width.
            width = k.shape[-1]
            both = _GatherOverCp.apply(torch.cat([k, v], dim=-1), self.group, self.cp)  # (batch, kv_heads, keys, k + v channels)
            k, v = both[..., :width], both[..., width:]
        return k, v, self.mask(window)

    def mask(self, window: int) -> torch.Tensor:
        """Which of the gathered keys each of this rank's queries sees: (seq, keys) bool, or
        (batch, 1, seq, keys) with documents."""
        query, key = self.queries[:, None], self.keys[None, :]
        visible = key <= query  # (seq, keys): causal on absolute positions, any key order
        if window:
            visible = visible & (query - key < window)
        if self.documents is not None:
            docs = self.documents.to(query.device)  # (batch, whole seq)
            same = docs[:, self.queries][:, :, None] == docs[:, self.keys][:, None, :]  # (batch, seq, keys)
            visible = (visible & same)[:, None]  # (batch, 1, seq, keys)
        return visible

    def advance(self, seq: int) -> None:
        pass


class ContextParallel:
    """Hands every attention layer of this rank its `SequenceView` (see the module docstring)."""

    def __init__(self, cp: int, rank: int, group, doc_mask: bool):
        self.cp, self.rank, self.group, self.doc_mask = cp, rank, group, doc_mask
        self._positions: dict = {}

    def view(self, local_len: int, device) -> SequenceView:
        key = (local_len, str(device))
        if key not in self._positions:
            seq = local_len * self.cp
            self._positions[key] = (chunk_positions(seq, self.cp, self.rank, device),
                                    torch.cat([chunk_positions(seq, self.cp, r, device) for r in range(self.cp)]))
        documents = _documents[0]
        if self.doc_mask and documents is None:
            raise RuntimeError("--doc-mask: no document ids for this forward (wrap it in document_ids)")
        return SequenceView(*self._positions[key], self.group, self.cp, documents if self.doc_mask else None)

    def hook(self, module: nn.Module, args: tuple):
        if len(args) > 2 and args[2] is not None:
            return None  # a real cache (generation): every rank runs the whole sequence itself
        x, rope = args[:2]
        return (x, rope, self.view(x.shape[1], x.device))  # x: (batch, this rank's seq, dim)


def apply_context_parallel(model: nn.Module, mesh, *, doc_mask: bool = False) -> nn.Module:
    """Give every attention layer of `model` (a model or pipeline chunk) the whole sequence's
    keys over the cp group, and with `doc_mask` a document mask. No-op without either."""
    if mesh.cp == 1 and not doc_mask:
        return model
    context = ContextParallel(mesh.cp, mesh.cp_rank, mesh.cp_group(), doc_mask)
    for block in model.layers.values():
        block.attention.register_forward_pre_hook(context.hook)
    return model
