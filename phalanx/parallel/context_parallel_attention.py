"""Context parallelism's attention: a rank's queries against the keys of the whole sequence,
block by block with the flash kernels (no mask), merged by log-sum-exp
(context_parallel_blocks.py holds the kernel calls on one block and the merge).

The blocks (context_parallel_layout.py) are unmasked or causal with queries and keys of one
length, exactly what the kernels take without a mask. The causal half of the sequence is
skipped by construction (no block covers it), so a rank does ~(seq/cp) x seq / 2 query-key
pairs. Key and value gradients of blocks shared by several query ranges add up.

Both directions are custom ops (`phalanx::cp_attention`, `phalanx::cp_attention_backward`):
opaque to dynamo, so `--compile` keeps a block's one graph (the per-document blocks of
`--doc-mask` depend on the data, which a traced graph could not loop over), and autograd sees
one node per layer.

Given a cp group, the op takes this rank's own keys and values and gathers the rest itself,
overlapped with the diagonal blocks, and reduce-scatters their gradients, overlapped with the
diagonal blocks' backward (context_parallel_schedule.py); or, with the plan's `cp_ring=true`,
passes them around the cp ranks, each step's transfer overlapped with a step of attention
(context_parallel_ring.py). Given none (cp=1 under `--doc-mask`, or latent attention, whose
gather comes before its decompression), the whole sequence's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.parallel.context_parallel_blocks import block_backward, block_forward, merge
from phalanx.parallel.context_parallel_layout import KeyBlock, row_blocks
from phalanx.parallel.context_parallel_ring import ring_backward, ring_forward
from phalanx.parallel.context_parallel_schedule import PendingGather, PendingReduceScatter


def _local_keys(block: KeyBlock, chunks: list[int], chunk: int) -> slice:
    """Where a causal block's keys (inside its own query chunk) lie among this rank's own keys."""
    slot = block.query_start // chunk
    shift = slot * chunk - chunks[slot] * chunk
    return slice(block.key_start + shift, block.key_end + shift)


def _group(group_name: str):
    # A custom op takes no process group, only its name; torch's functional collectives
    # resolve names the same way (present in torch 2.11 and 2.13).
    return dist.distributed_c10d._resolve_process_group(group_name) if group_name else None


def _output(q: torch.Tensor, channels: int) -> torch.Tensor:
    """(batch, heads, queries, channels), laid out as (batch, queries, heads, channels) as the
    kernels lay out theirs: the attention's `transpose(1, 2).reshape` before its output
    projection is then a view, not a second copy kept for backward."""
    batch, heads, queries, _ = q.shape
    return q.new_empty((batch, queries, heads, channels)).transpose(1, 2)


def attend_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None,
                  chunks: list[int], scale: float, cp: int, group_name: str, ring: bool) -> tuple[torch.Tensor, ...]:
    """The forward of `phalanx::cp_attention`. q (batch, heads, len(chunks) * chunk, d): this
    rank's queries, chunk after chunk; `documents` (batch, seq) ids or None. With a
    `group_name`, k and v (batch, kv_heads, queries, d or dv) are this rank's own, gathered over
    the cp group here while the diagonal blocks compute (context_parallel_schedule.py); without,
    they are the whole sequence's in position order. -> out (batch, heads, queries, dv), lse
    (batch, heads, queries) fp32, and the gathered keys and values side by side on the
    channels (empty without a group), kept for backward. `ring`: with a group, the keys go
    around the cp ranks instead (context_parallel_ring.py)."""
    batch, heads, queries, _ = q.shape
    chunk = queries // len(chunks)
    group = _group(group_name)
    if ring and group is not None:
        return ring_forward(q, k, v, documents, chunks, scale, cp, group, _output(q, v.shape[-1]))
    with torch.profiler.record_function("cp: issue the key/value gather"):
        pending = PendingGather(k, v, group, cp) if group is not None else None
    rows = row_blocks(batch, documents, chunks, chunk)
    parts: dict[tuple, list] = {}
    with torch.profiler.record_function("cp: diagonal blocks"):
        for r, (row, by_range) in enumerate(rows):
            for key, blocks in by_range.items():
                for b in blocks:
                    if b.causal:
                        keys = _local_keys(b, chunks, chunk) if pending else slice(b.key_start, b.key_end)
                        parts.setdefault((r, key), []).append(block_forward(
                            q[row, :, key[0]:key[1]], k[row, :, keys], v[row, :, keys], True, scale))
    kv_all = pending.wait() if pending else k.new_empty(0)  # (batch, kv_heads, seq, d + dv) in position order
    k_all, v_all = (kv_all[..., :k.shape[-1]], kv_all[..., k.shape[-1]:]) if pending else (k, v)
    out = _output(q, v.shape[-1])
    lse = q.new_empty((batch, heads, queries), dtype=torch.float32)
    with torch.profiler.record_function("cp: blocks before the chunks"):
        for r, (row, by_range) in enumerate(rows):
            for (q0, q1), blocks in by_range.items():
                mine = parts[(r, (q0, q1))]
                mine += [block_forward(q[row, :, q0:q1], k_all[row, :, b.key_start:b.key_end],
                                       v_all[row, :, b.key_start:b.key_end], False, scale)
                         for b in blocks if not b.causal]
                out[row, :, q0:q1], lse[row, :, q0:q1] = merge(mine, out.dtype)
    return out, lse, kv_all


@torch.library.custom_op("phalanx::cp_attention", mutates_args=())
def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None,
                 chunks: list[int], scale: float, cp: int, group_name: str,
                 ring: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attend_blocks(q, k, v, documents, chunks, scale, cp, group_name, ring)


@cp_attention.register_fake
def _(q, k, v, documents, chunks, scale, cp, group_name, ring):
    kv_all = k.new_empty((*k.shape[:2], k.shape[2] * cp, k.shape[3] + v.shape[3])) if group_name else k.new_empty(0)
    return _output(q, v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32), kv_all


def attend_blocks_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, kv_all: torch.Tensor, documents: torch.Tensor | None,
                           chunks: list[int], scale: float, cp: int, group_name: str,
                           ring: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of `phalanx::cp_attention`: dq, dk, dv (of its inputs). With a group, k
    and v are not kept (empty here): the diagonal blocks read this rank's own keys from the
    gathered ones, and the gradients of the others are reduce-scattered while the diagonal
    blocks' compute (with `ring`, passed around the ring: context_parallel_ring.py)."""
    batch, _, queries, width = q.shape
    chunk = queries // len(chunks)
    group = _group(group_name)
    if ring and group is not None:
        return ring_backward(grad, q, out, lse, kv_all, documents, chunks, scale, cp, group)
    k_all, v_all = (kv_all[..., :width], kv_all[..., width:]) if group is not None else (k, v)
    rows = row_blocks(batch, documents, chunks, chunk)
    # fp32 sums: a key block's gradient adds up over every query range that reads it.
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = (torch.zeros((*t.shape[:2], queries, t.shape[3]), dtype=torch.float32, device=t.device)
              for t in (k_all, v_all))  # this rank's own, with a group
    dk_all, dv_all = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k_all, v_all))
    for causal in (False, True):
        if causal and group is not None:
            with torch.profiler.record_function("cp: issue the gradient reduce-scatter"):
                pending = PendingReduceScatter(dk_all.to(kv_all.dtype), dv_all.to(kv_all.dtype), group, cp)
        with torch.profiler.record_function("cp: diagonal block gradients" if causal else "cp: other block gradients"):
            for row, by_range in rows:
                for (q0, q1), blocks in by_range.items():
                    for b in blocks:
                        if b.causal != causal:
                            continue
                        keys = slice(b.key_start, b.key_end)
                        to, dk_to, dv_to = keys, dk_all, dv_all
                        if causal and group is not None:  # its keys are this rank's own
                            to, dk_to, dv_to = _local_keys(b, chunks, chunk), dk, dv
                        gq, gk, gv = block_backward(grad[row, :, q0:q1], q[row, :, q0:q1], k_all[row, :, keys],
                                                    v_all[row, :, keys], out[row, :, q0:q1], lse[row, :, q0:q1],
                                                    causal, scale)
                        dq[row, :, q0:q1] += gq
                        dk_to[row, :, to] += gk
                        dv_to[row, :, to] += gv
    if group is None:
        return dq.to(q.dtype), dk_all.to(k.dtype), dv_all.to(v.dtype)
    dk_others, dv_others = pending.wait()
    return dq.to(q.dtype), (dk + dk_others).to(kv_all.dtype), (dv + dv_others).to(kv_all.dtype)


@torch.library.custom_op("phalanx::cp_attention_backward", mutates_args=())
def cp_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, kv_all: torch.Tensor, documents: torch.Tensor | None,
                          chunks: list[int], scale: float, cp: int, group_name: str,
                          ring: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attend_blocks_backward(grad, q, k, v, out, lse, kv_all, documents, chunks, scale, cp, group_name, ring)


@cp_attention_backward.register_fake
def _(grad, q, k, v, out, lse, kv_all, documents, chunks, scale, cp, group_name, ring):
    # Contiguous, as the real gradients are (not empty_like, which would copy a transposed input's strides).
    if not group_name:
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    batch, kv_heads, _, channels = kv_all.shape
    local, width = q.shape[2], q.shape[3]
    return (q.new_empty(q.shape), kv_all.new_empty((batch, kv_heads, local, width)),
            kv_all.new_empty((batch, kv_heads, local, channels - width)))


def _setup_context(ctx, inputs, output):
    q, k, v, documents, chunks, scale, cp, group_name, ring = inputs
    out, lse, kv_all = output
    if group_name:  # the diagonal blocks' backward reads this rank's keys from the gathered ones
        k, v = k.new_empty(0), v.new_empty(0)
    ctx.save_for_backward(q, k, v, out, lse, kv_all, documents)
    ctx.settings = chunks, scale, cp, group_name, ring


def _backward(ctx, grad_out, *_):
    q, k, v, out, lse, kv_all, documents = ctx.saved_tensors
    dq, dk, dv = cp_attention_backward(grad_out.contiguous(), q, k, v, out, lse, kv_all, documents,
                                       *ctx.settings)
    return dq, dk, dv, None, None, None, None, None, None


cp_attention.register_autograd(_backward, setup_context=_setup_context)


@dataclass
class ChunkAttention:
    """What a cp rank's attention gets from its `SequenceView` in place of a mask (the
    interface of a serving step's `RaggedAttention`: `AttentionCore` calls `attend`): its
    queries are the chunks `chunks`. With a `group_name` (a cp group's), the keys and values it
    is handed are this rank's own and it gathers the rest itself (or, with `ring`, has them
    passed around the cp ranks); without, they are the whole sequence's in position order."""
    chunks: list[int]
    documents: torch.Tensor | None = None
    """(batch, seq) document ids in position order under `--doc-mask`, else None."""
    cp: int = 1
    group_name: str = ""
    ring: bool = False
    """The plan's cp_ring: keys and values around a ring of the cp ranks, not all-gathered."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """q (batch, heads, queries, d), k and v (batch, kv_heads, keys, d or dv) -> (batch, heads, queries, dv)."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale  # scaled_dot_product_attention's default
        return cp_attention(q, k, v, self.documents, self.chunks, scale, self.cp, self.group_name, self.ring)[0]
