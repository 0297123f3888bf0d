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

Under `--compile` (parallel/compile.py compiles each block) the hook and the gather are traced
into the block's one graph: dynamo inlines a submodule's hooks, and the gather is torch's
functional all-gather, whose reduce-scatter lands in the compiled backward.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol

from phalanx.data.batches import chunk_positions
from phalanx.model.kv_cache import attention_mask

_documents: list[torch.Tensor | None] = [None]
"""The document id of every position of the micro-batch in flight, (batch, seq), set by
`document_ids` around its forward and backward (recomputation runs the forward again there);
under pp, around each stage's forward and backward of one micro-batch (`pipeline.MicrobatchDocuments`).
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


_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
"""torch's traceable all-gather on dim 0 (a functional collective) whose backward is a sum
reduce-scatter: its torch 2.13 name, else the older one (torch 2.11, 2.12)."""


def gather_over_cp(local: torch.Tensor, group) -> torch.Tensor:
    """(..., L, c) on each of cp ranks -> (..., cp * L, c), rank r's positions at r*L..(r+1)*L.

    Its backward sums every rank's gradient of this rank's part (a reduce-scatter): torch's
    functional collective registers it, and dynamo traces it into a compiled block's forward
    and backward graphs (`--compile`), where a process-group call in an autograd.Function of
    our own would rely on dynamo rewriting it."""
    stacked = _all_gather(local.movedim(-2, 0).contiguous(), 0, group)  # (cp * L, ..., c)
    return stacked.movedim(0, -2)  # (..., cp * L, c)


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
            both = gather_over_cp(torch.cat([k, v], dim=-1), self.group)  # (batch, kv_heads, keys, k + v channels)
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


class WholeSequence:
    """An `AttentionCache` that holds nothing: each forward's attention sees its own tokens from
    position 0, causally, as without a cache. Passed where every rank runs a whole sequence
    without a KV cache (a pipeline's sampling forwards), so that the cp and `--doc-mask` hook,
    which leaves real caches alone, leaves this forward alone too."""

    def positions(self, seq: int, device) -> torch.Tensor:
        return torch.arange(seq, device=device)  # (seq,)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return k, v, attention_mask(k.shape[2], k.shape[2], window, k.device)

    def advance(self, seq: int) -> None:
        pass


class ContextParallel:
    """Hands every attention layer of this rank its `SequenceView` (see the module docstring)."""

    def __init__(self, cp: int, rank: int, group, doc_mask: bool):
        self.cp, self.rank, self.group, self.doc_mask = cp, rank, group, doc_mask

    def view(self, local_len: int, device) -> SequenceView:
        # Positions made afresh for every layer (a few aranges), not cached on this object: under
        # --compile the hook runs inside the block's graph, where a cache filled on the first
        # call changes what the guards see and compiles the block a second time.
        seq = local_len * self.cp
        queries = chunk_positions(seq, self.cp, self.rank, device)  # (local_len,)
        keys = torch.cat([chunk_positions(seq, self.cp, r, device) for r in range(self.cp)])  # (seq,) in rank order
        documents = _documents[0]
        if self.doc_mask and documents is None:
            raise RuntimeError("--doc-mask: no document ids for this forward (wrap it in document_ids)")
        return SequenceView(queries, keys, self.group, self.cp, documents if self.doc_mask else None)

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
