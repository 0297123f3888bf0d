"""Context parallelism: each sequence split over the cp ranks, attention over the whole of it.

Each sequence is cut into 2 x cp equal chunks and cp rank i holds chunks i and 2cp-1-i, so
under the causal mask every rank computes the same number of query-key pairs. Everything but
attention works per position and needs nothing from the other ranks; attention needs every
earlier key. Three small pieces do it:
- context_parallel_layout.py: which positions a rank holds, and the blocks of keys its queries
  see (each chunk's causal diagonal and the unmasked keys before it; per document under
  `--doc-mask`): no (queries x keys) mask is ever built;
- context_parallel_attention.py: the flash kernels on those blocks (context_parallel_blocks.py),
  merged by log-sum-exp;
- context_parallel_schedule.py: the all-gather of keys and values over the cp group (whose
  backward reduce-scatters their gradients), or with the plan's `cp_ring=true` a ring of
  point-to-point passes, each overlapped with a step of attention (context_parallel_ring.py).
The loss is each rank's mean over its tokens; gradients are then averaged over the dp x cp
ranks (every rank holds as many tokens), which is the global batch's mean, as one process
computes it.

The model stays single-device: its attention already asks an `AttentionCache` (kv_cache.py)
for the positions of its tokens and for the keys it sees. A forward pre-hook on each attention
layer hands it a `SequenceView` that answers from the cp group instead of a cache: the whole
sequence's keys and values, and in place of a mask a `ChunkAttention` whose `attend` computes
the attention (the interface of a serving step's paged cache); generation (which passes a real
cache) is left alone. With `--doc-mask`, the same view also keeps attention inside each
document of a packed sequence (`document_ids`), with or without cp.

Sliding-window attention is refused with cp or `--doc-mask` (`plan_model_checks.validate_cp`):
the blocks are whole or causal, and a window would need a band mask inside them.

Under `--compile` (parallel/compile.py compiles each block) the hook and the gather are traced
into the block's one graph: dynamo inlines a submodule's hooks, the gather is torch's
functional all-gather, and the attention is one custom op each way.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from phalanx.data.batches import chunk_positions
from phalanx.model.kv_cache import attention_mask
from phalanx.model.latent_attention import LatentAttention
from phalanx.parallel.context_parallel_attention import ChunkAttention
from phalanx.parallel.context_parallel_layout import rank_chunks
from phalanx.parallel.context_parallel_schedule import gather_keys_values

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


class SequenceView:
    """What one forward's attention layers see of the whole sequence (the `AttentionCache`
    calls, kv_cache.py): this rank's positions, every key and value of the sequence in
    position order, and a `ChunkAttention` in place of a mask."""

    def __init__(self, queries: torch.Tensor, group, cp: int, rank: int, documents: torch.Tensor | None,
                 gather_here: bool, ring: bool = False):
        self.queries, self.group, self.cp, self.gather_here = queries, group, cp, gather_here or cp == 1
        # Without gather_here, the attention gathers the keys itself, overlapped with its diagonal
        # blocks, or (ring) passes them around the cp ranks, overlapped with each step's blocks.
        self.attention = ChunkAttention(rank_chunks(cp, rank), documents, cp,
                                        "" if self.gather_here else group.group_name, ring and not self.gather_here)

    def positions(self, seq: int, device) -> torch.Tensor:
        return self.queries  # (seq,) absolute positions of this rank's two chunks

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               window: int) -> tuple[torch.Tensor, torch.Tensor, ChunkAttention]:
        if window:  # plan_model_checks.validate_cp refuses it before launch; this is for library callers
            raise ValueError(f"context parallelism and --doc-mask do not support sliding-window attention "
                             f"(window {window}): their attention blocks are whole or causal, never banded")
        if not self.gather_here:
            return k, v, self.attention  # this rank's own: the attention gathers the rest
        if self.cp > 1:
            k, v = gather_keys_values(k, v, self.group, self.cp)  # (batch, kv_heads, seq, channels)
        return k, v, self.attention

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

    def __init__(self, cp: int, rank: int, group, doc_mask: bool, ring: bool = False):
        self.cp, self.rank, self.group, self.doc_mask, self.ring = cp, rank, group, doc_mask, ring

    def view(self, local_len: int, device, gather_here: bool = False) -> SequenceView:
        # Positions made afresh for every layer (a few aranges), not cached on this object: under
        # --compile the hook runs inside the block's graph, where a cache filled on the first
        # call changes what the guards see and compiles the block a second time.
        queries = chunk_positions(local_len * self.cp, self.cp, self.rank, device)  # (local_len,)
        documents = _documents[0]
        if self.doc_mask and documents is None:
            raise RuntimeError("--doc-mask: no document ids for this forward (wrap it in document_ids)")
        return SequenceView(queries, self.group, self.cp, self.rank, documents if self.doc_mask else None, gather_here,
                            self.ring)

    def hook(self, module: nn.Module, args: tuple):
        if len(args) > 2 and args[2] is not None:
            return None  # a real cache (generation): every rank runs the whole sequence itself
        x, rope = args[:2]
        # Latent attention decompresses per-head keys from what its cache returns: so that only
        # the latents travel, the view gathers them before (not inside) its attention.
        gather_here = isinstance(module, LatentAttention)
        return (x, rope, self.view(x.shape[1], x.device, gather_here))  # x: (batch, this rank's seq, dim)


def apply_context_parallel(model: nn.Module, mesh, *, doc_mask: bool = False) -> nn.Module:
    """Give every attention layer of `model` (a model or pipeline chunk) the whole sequence's
    keys over the cp group (all-gathered, or around a ring with the plan's `cp_ring=true`), and
    with `doc_mask` a document mask. No-op without either."""
    if mesh.cp == 1 and not doc_mask:
        return model
    context = ContextParallel(mesh.cp, mesh.cp_rank, mesh.cp_group(), doc_mask, mesh.plan.cp_ring)
    for block in model.layers.values():
        block.attention.register_forward_pre_hook(context.hook)
    return model
