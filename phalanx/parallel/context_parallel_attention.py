"""Context parallelism's attention merge: a rank's queries against the keys of the whole
sequence, block by block with the flash kernels (no mask), merged by log-sum-exp.

The blocks (context_parallel_layout.py) are unmasked or causal with queries and keys of one
length, exactly what the kernels take without a mask (`is_causal`'s top-left alignment is
right for a square block): torch's flash kernel for CPU, FlashAttention-2 on CUDA in bf16/fp16,
the memory-efficient kernel on CUDA in fp32. Each returns its output and the log-sum-exp of
each query's scores; the blocks of one query range merge as
    lse = log(sum_i exp(lse_i)),  out = sum_i exp(lse_i - lse) out_i,
which is softmax over the union of their keys. The causal half of the sequence is skipped
by construction (no block covers it), so a rank does ~(seq/cp) x seq / 2 query-key pairs.

Backward is the flash backward of each block, given the merged output and the merged
log-sum-exp (as ring attention does): the kernel recomputes each block's probabilities as
exp(scores - lse), the merged softmax's own, and its D = rowsum(dout * out) is the merged one,
so the per-block gradients add up to the gradient of the merged softmax. Key and value
gradients of blocks shared by several query ranges add up.

Both directions are custom ops (`phalanx::cp_attention`, `phalanx::cp_attention_backward`):
opaque to dynamo, so `--compile` keeps a block's one graph (the per-document blocks of
`--doc-mask` depend on the data, which a traced graph could not loop over), and autograd sees
one node per layer. Grouped-query attention repeats a block's kv heads for the kernel call
only (the kernels want one kv head per query head) and sums their gradients back; value
channels that differ from the key's (latent attention) are padded with zeros to the kernel's
one head size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from phalanx.parallel.context_parallel_layout import KeyBlock, causal_blocks, document_blocks, document_runs


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, kv_heads, keys, c) -> (batch, heads, keys, c), each kv head for its heads / kv_heads query heads."""
    batch, kv_heads, keys, c = t.shape
    if kv_heads == heads:
        return t
    return t[:, :, None].expand(batch, kv_heads, heads // kv_heads, keys, c).reshape(batch, heads, keys, c)


def _sum_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    batch, heads, keys, c = grad.shape
    if kv_heads == heads:
        return grad
    return grad.view(batch, kv_heads, heads // kv_heads, keys, c).sum(2)  # (batch, kv_heads, keys, c)


def _widths(q: torch.Tensor, v: torch.Tensor) -> int:
    """The one head size the kernels take: the larger of the key's and the value's."""
    return max(q.shape[-1], v.shape[-1])


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q (batch, heads, queries, d), k (batch, kv_heads, keys, d), v (batch,
    kv_heads, keys, dv) -> out (batch, heads, queries, dv), lse (batch, heads, queries) fp32."""
    heads, dv, width = q.shape[1], v.shape[-1], _widths(q, v)
    qp, kp, vp = _pad(q, width), _pad(_repeat_kv(k, heads), width), _pad(_repeat_kv(v, heads), width)
    if not q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qp, kp, vp, 0.0, causal, scale=scale)
    elif q.dtype in (torch.float16, torch.bfloat16):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(qp, kp, vp, 0.0, causal, False, scale=scale)
    else:  # fp32 on CUDA: the memory-efficient kernel, whose lse is padded to a multiple of 32 queries
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(qp, kp, vp, None, True, 0.0, causal,
                                                                             scale=scale)
        lse = lse[..., :q.shape[2]]
    return out[..., :dv], lse.float()


def block_backward(grad, q, k, v, out, lse, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """One block's dq, dk, dv given the merged `out` and `lse` of its queries (module docstring)."""
    heads, kv_heads, dv, width = q.shape[1], k.shape[1], v.shape[-1], _widths(q, v)
    qp, kp, vp = _pad(q, width), _pad(_repeat_kv(k, heads), width), _pad(_repeat_kv(v, heads), width)
    gp, op = _pad(grad, width), _pad(out, width)
    if not q.is_cuda:
        dq, dk, dvv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            gp, qp, kp, vp, op, lse, 0.0, causal, scale=scale)
    elif q.dtype in (torch.float16, torch.bfloat16):
        none = torch.empty(0, dtype=torch.int64, device=q.device)  # no varlen, no dropout: unread
        dq, dk, dvv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            gp, qp, kp, vp, op, lse, none, none, q.shape[2], k.shape[2], 0.0, causal, none, none, scale=scale)
    else:
        padded = -(-q.shape[2] // 32) * 32
        lse_p = F.pad(lse, (0, padded - q.shape[2]))
        none = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dvv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            gp, qp, kp, vp, none, op, lse_p, none, none, 0.0, [True, True, True, False], causal, scale=scale)
    return (dq[..., :q.shape[-1]], _sum_kv(dk[..., :k.shape[-1]], kv_heads), _sum_kv(dvv[..., :dv], kv_heads))


def _row_blocks(batch: int, documents: torch.Tensor | None, chunks: list[int],
                chunk: int) -> list[tuple[slice, dict[tuple[int, int], list[KeyBlock]]]]:
    """[(batch rows, {query range: its blocks})]: all rows at once without documents, else row by row."""
    if documents is None:
        rows = [(slice(None), causal_blocks(chunks, chunk))]
    else:
        rows = [(slice(i, i + 1), document_blocks(chunks, chunk, document_runs(documents[i]))) for i in range(batch)]
    out = []
    for row, blocks in rows:
        by_range: dict[tuple[int, int], list[KeyBlock]] = {}
        for block in blocks:
            by_range.setdefault((block.query_start, block.query_end), []).append(block)
        out.append((row, by_range))
    return out


def attend_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None,
                  chunks: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of `phalanx::cp_attention`. q (batch, heads, len(chunks) * chunk, d): this rank's queries, chunk after chunk; k, v
    (batch, kv_heads, seq, d or dv): the whole sequence's keys and values in position order;
    `documents` (batch, seq) ids or None -> out (batch, heads, queries, dv), lse (batch, heads, queries) fp32."""
    batch, heads, queries, _ = q.shape
    out = q.new_empty((batch, heads, queries, v.shape[-1]))
    lse = q.new_empty((batch, heads, queries), dtype=torch.float32)
    for row, by_range in _row_blocks(batch, documents, chunks, queries // len(chunks)):
        for (q0, q1), blocks in by_range.items():
            parts = [block_forward(q[row, :, q0:q1], k[row, :, b.key_start:b.key_end], v[row, :, b.key_start:b.key_end],
                                   b.causal, scale) for b in blocks]
            if len(parts) == 1:
                out[row, :, q0:q1], lse[row, :, q0:q1] = parts[0]
                continue
            lses = torch.stack([part[1] for part in parts])  # (blocks, batch, heads, queries)
            merged = torch.logsumexp(lses, dim=0)
            weights = torch.exp(lses - merged)[..., None]  # (blocks, batch, heads, queries, 1)
            out[row, :, q0:q1] = sum(w * part[0].float() for w, part in zip(weights, parts)).to(out.dtype)
            lse[row, :, q0:q1] = merged
    return out, lse


@torch.library.custom_op("phalanx::cp_attention", mutates_args=())
def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None,
                 chunks: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return attend_blocks(q, k, v, documents, chunks, scale)


@cp_attention.register_fake
def _(q, k, v, documents, chunks, scale):
    return q.new_empty((*q.shape[:3], v.shape[-1])), q.new_empty(q.shape[:3], dtype=torch.float32)


def attend_blocks_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, documents: torch.Tensor | None, chunks: list[int],
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of `phalanx::cp_attention`: dq, dk, dv."""
    batch, _, queries, _ = q.shape
    # fp32 sums: a key block's gradient adds up over every query range that reads it.
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    for row, by_range in _row_blocks(batch, documents, chunks, queries // len(chunks)):
        for (q0, q1), blocks in by_range.items():
            for b in blocks:
                keys = slice(b.key_start, b.key_end)
                gq, gk, gv = block_backward(grad[row, :, q0:q1], q[row, :, q0:q1], k[row, :, keys], v[row, :, keys],
                                            out[row, :, q0:q1], lse[row, :, q0:q1], b.causal, scale)
                dq[row, :, q0:q1] += gq
                dk[row, :, keys] += gk
                dv[row, :, keys] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("phalanx::cp_attention_backward", mutates_args=())
def cp_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, documents: torch.Tensor | None, chunks: list[int],
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attend_blocks_backward(grad, q, k, v, out, lse, documents, chunks, scale)


@cp_attention_backward.register_fake
def _(grad, q, k, v, out, lse, documents, chunks, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, documents, chunks, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], documents)
    ctx.chunks, ctx.scale = chunks, scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, documents = ctx.saved_tensors
    dq, dk, dv = cp_attention_backward(grad_out.contiguous(), q, k, v, out, lse, documents, ctx.chunks, ctx.scale)
    return dq, dk, dv, None, None, None


cp_attention.register_autograd(_backward, setup_context=_setup_context)


@dataclass
class ChunkAttention:
    """What a cp rank's attention gets from its `SequenceView` in place of a mask (the
    interface of a serving step's `RaggedAttention`: `AttentionCore` calls `attend`): its
    queries are the chunks `chunks`, the keys and values it is handed are the whole
    sequence's in position order."""
    chunks: list[int]
    documents: torch.Tensor | None = None
    """(batch, seq) document ids in position order under `--doc-mask`, else None."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """q (batch, heads, queries, d), k and v (batch, kv_heads, seq, d or dv) -> (batch, heads, queries, dv)."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale  # scaled_dot_product_attention's default
        return cp_attention(q, k, v, self.documents, self.chunks, scale)[0]
