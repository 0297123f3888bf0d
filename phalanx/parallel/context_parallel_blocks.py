"""Context parallelism's attention on one block of keys: the flash kernels without a mask,
each returning its output and the log-sum-exp of each query's scores, and the merge of blocks
of the same queries by their log-sum-exp,
    lse = log(sum_i exp(lse_i)),  out = sum_i exp(lse_i - lse) out_i,
which is softmax over the union of their keys. A block is unmasked, or causal with queries and
keys of one length (`is_causal`'s top-left alignment is right for a square block): torch's
flash kernel for CPU, FlashAttention-2 on CUDA in bf16/fp16, the memory-efficient kernel on
CUDA in fp32.

Backward is the flash backward of each block, given the merged output and the merged
log-sum-exp (as ring attention does): the kernel recomputes each block's probabilities as
exp(scores - lse), the merged softmax's own, and its D = rowsum(dout * out) is the merged one,
so the per-block gradients add up to the gradient of the merged softmax.

Grouped-query attention repeats a block's kv heads for the kernel call only (the kernels want
one kv head per query head) and sums their gradients back; value channels that differ from the
key's (latent attention) are padded with zeros to the kernel's one head size. The CUDA kernel
calls follow the ops' schemas of torch 2.11 and 2.13 (their meta kernels accept these
arguments) but have not yet run on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        # The forward's bookkeeping outputs (no varlen: no cumulative lengths; no dropout: its
        # random state unread), as autograd would pass them, taken from a one-query forward.
        one = qp[:1, :1, :1]
        _, _, cum_q, cum_k, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            one, one, one, 0.0, False, False, scale=scale)
        dq, dk, dvv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            gp, qp, kp, vp, op, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    else:
        # The kernel's log-sum-exp may be padded past the queries: pad the merged one as its
        # forward would (its shape from the meta kernel), and its random state as a forward's.
        meta = [t.to("meta") for t in (qp, kp, vp)]
        padded = torch.ops.aten._scaled_dot_product_efficient_attention(*meta, None, True, 0.0, causal,
                                                                         scale=scale)[1].shape[-1]
        lse_p = F.pad(lse, (0, padded - q.shape[2]))
        one = qp[:1, :1, :1]
        _, _, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(one, one, one, None, True, 0.0, False,
                                                                                   scale=scale)
        dq, dk, dvv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            gp, qp, kp, vp, None, op, lse_p, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return (dq[..., :q.shape[-1]], _sum_kv(dk[..., :k.shape[-1]], kv_heads), _sum_kv(dvv[..., :dv], kv_heads))


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks' (out, lse) of the same queries -> the softmax over the union of their keys."""
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([part[1] for part in parts])  # (blocks, batch, heads, queries)
    merged = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - merged)[..., None]  # (blocks, batch, heads, queries, 1)
    return sum(w * part[0].float() for w, part in zip(weights, parts)).to(dtype), merged
