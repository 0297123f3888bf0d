"""Context parallelism's ring schedule (plan key `cp_ring=true`): keys and values passed around
the cp ranks, one rank's at a time, while attention runs on the ones at hand, in place of the
all-gather; in backward, their gradients passed around the same ring, each rank adding its part,
while the next rank's gradient blocks compute, in place of the reduce-scatter.

Forward, on cp rank r, step s = 0 .. cp-1 holds the keys and values of rank r - s (its own at
step 0): it passes them on to rank r + 1 (and receives those of rank r - s - 1), computes the
blocks of its queries against the keys it holds (`owner_blocks`: each chunk's diagonal at step
0, whole blocks otherwise), and only then waits for the next ones. With the load-balanced
chunks every step is the same work: rank r's chunks r and 2cp-1-r against rank j's chunks j and
2cp-1-j are two whole (chunk x chunk) blocks for every j != r (query chunk 2cp-1-r sees chunk j,
and chunk r sees chunk j if j < r, else chunk 2cp-1-r sees chunk 2cp-1-j), and at j = r the two
causal diagonals and one whole block. So each of the cp - 1 transfers hides behind one of cp
equal steps of attention (`planner/stage_time.cp_exposed`). Each piece is copied into its
place in position order as it arrives, and the whole kept for backward, as the gather's result
is: the same memory, with no second whole-sequence buffer to reorder.

Backward, step s computes the key/value gradient blocks of rank r - 1 - s's keys (its own last),
adds the partial sum rank r - 1 received for them (every rank before it on the ring added its
part), and passes the sum on to rank r + 1 while step s + 1 computes; after cp - 1 passes each
rank holds the sum of every rank's gradients of its own keys, as the reduce-scatter gives it.
The partial sums travel in the keys' dtype, as a reduce-scatter's ring adds them in it.

Latent attention decompresses its keys after the gather, so only the latents travel: it keeps
the gather (`layout_rules.cp_ring_problem` refuses cp_ring=true for it, before launch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.layout_rules import cp_chunks
from phalanx.parallel.context_parallel_blocks import block_backward, block_forward, merge
from phalanx.parallel.context_parallel_layout import owner_blocks, row_blocks
from phalanx.parallel.context_parallel_schedule import PendingPass


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None,
                 chunks: list[int], scale: float, cp: int, group,
                 out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (batch, heads, 2 chunk, d): this rank's queries, chunk after chunk; this rank's own k
    and v (batch, kv_heads, 2 chunk, d or dv); `out` the (batch, heads, queries, dv) tensor to
    fill. -> out, lse (batch, heads, queries) fp32, and the whole sequence's keys and values side
    by side in position order (batch, kv_heads, seq, d + dv), kept for backward."""
    batch, heads, queries, width = q.shape
    chunk, rank = queries // 2, dist.get_rank(group)
    rows = row_blocks(batch, documents, chunks, chunk)
    held = torch.cat([k, v], dim=-1)  # (batch, kv_heads, 2 chunk, d + dv): this rank's own
    # Filled in position order as the keys come round (no gathered copy to reorder afterwards).
    kv_all = held.new_empty((*held.shape[:2], cp * queries, held.shape[3]))
    merged: dict[tuple[int, tuple[int, int]], tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(cp):
        owner = (rank - step) % cp
        pending = None
        if step < cp - 1:
            with torch.profiler.record_function("cp ring: pass keys/values on"):
                pending = PendingPass(held, group, "next keys/values")
        for slot, c in enumerate(cp_chunks(cp, owner)):  # while they travel on
            kv_all[:, :, c * chunk:(c + 1) * chunk] = held[:, :, slot * chunk:(slot + 1) * chunk]
        with torch.profiler.record_function("cp ring: blocks of the keys at hand"):
            for r, (row, by_range) in enumerate(rows):
                for key_range, blocks in by_range.items():
                    q0, q1 = key_range
                    for b, local in owner_blocks(blocks, cp, chunk, owner):
                        keys = held[row, :, local:local + b.key_end - b.key_start]
                        part = block_forward(q[row, :, q0:q1], keys[..., :width], keys[..., width:], b.causal, scale)
                        # fp32 running merge: cp steps of rounding to a 16-bit dtype would add up.
                        before = merged.get((r, key_range))
                        merged[(r, key_range)] = part if before is None else merge([before, part], torch.float32)
        if pending is not None:
            held = pending.wait()
    lse = q.new_empty((batch, heads, queries), dtype=torch.float32)
    for r, (row, by_range) in enumerate(rows):
        for q0, q1 in by_range:
            part_out, part_lse = merged[(r, (q0, q1))]
            out[row, :, q0:q1], lse[row, :, q0:q1] = part_out.to(out.dtype), part_lse
    return out, lse, kv_all


def ring_backward(grad: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, kv_all: torch.Tensor,
                  documents: torch.Tensor | None, chunks: list[int], scale: float, cp: int,
                  group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ring_forward`'s backward, given the merged out and lse and the keys and values it kept:
    dq, and the gradients of this rank's own keys and values (batch, kv_heads, 2 chunk, d or dv)
    summed over every cp rank's queries."""
    batch, _, queries, width = q.shape
    chunk, rank = queries // 2, dist.get_rank(group)
    rows = row_blocks(batch, documents, chunks, chunk)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    pending = None
    for step in range(cp):
        owner = (rank - 1 - step) % cp  # this rank's own keys last
        # fp32 sums: a key's gradient adds up over every query range that reads it.
        mine = torch.zeros((*kv_all.shape[:2], 2 * chunk, kv_all.shape[3]), dtype=torch.float32, device=q.device)
        with torch.profiler.record_function("cp ring: gradient blocks of one rank's keys"):
            for row, by_range in rows:
                for (q0, q1), blocks in by_range.items():
                    for b, local in owner_blocks(blocks, cp, chunk, owner):
                        keys = kv_all[row, :, b.key_start:b.key_end]  # the block's keys are in position order
                        gq, gk, gv = block_backward(grad[row, :, q0:q1], q[row, :, q0:q1], keys[..., :width],
                                                    keys[..., width:], out[row, :, q0:q1], lse[row, :, q0:q1],
                                                    b.causal, scale)
                        dq[row, :, q0:q1] += gq
                        mine[row, :, local:local + b.key_end - b.key_start] += torch.cat([gk, gv], dim=-1)
        if pending is not None:
            mine += pending.wait()  # the ranks before this one on the ring: their parts of the same keys
        if step < cp - 1:
            with torch.profiler.record_function("cp ring: pass key/value gradients on"):
                pending = PendingPass(mine.to(kv_all.dtype), group, "key/value gradients")
    # Contiguous copies: the op's outputs may not alias each other (and are laid out as its fake says).
    dk, dv = (part.contiguous().to(kv_all.dtype) for part in (mine[..., :width], mine[..., width:]))
    return dq.to(q.dtype), dk, dv
