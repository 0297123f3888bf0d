"""The ring schedule of context parallelism (plan key `cp_ring=true`,
parallel/context_parallel_ring.py) computes the attention that one process computes, and
overlaps each step's transfer with the next step's attention.

The exactness test runs `ChunkAttention` with a real cp group of forked gloo ranks (cp = 2 and
4: with 4, keys reach a rank after 1, 2 and 3 hops and gradients come back over 3), each rank on
its two chunks, against masked attention of the whole sequence on one process (causal, and
within documents), output and the gradients of q, k and v, with the all-gather schedule beside
it. Tolerance 1e-5 (fp32): what differs is the order of float additions (the log-sum-exp merge
of up to cp + 1 blocks in ring order, the key/value gradients added up hop by hop), ~1e-7
relative each; a key block attended twice or skipped, a gradient added to the wrong rank's
keys or a hop short moves values by O(0.1).
"""

from __future__ import annotations

import pytest
import torch

from phalanx.errors import UserError
from phalanx.testing.fork_ranks import run_ranks

TOLERANCE = 1e-5


def _inputs(kv_heads: int):
    gen = torch.Generator().manual_seed(0)
    batch, heads, seq, dim = 2, 4, 32, 16
    q = torch.randn(batch, heads, seq, dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen)
    v = torch.randn(batch, kv_heads, seq, dim, generator=gen)
    weight = torch.randn(batch, heads, seq, dim, generator=gen)
    ids = torch.stack([torch.repeat_interleave(torch.arange(4), torch.tensor([5, 11, 9, 7])),
                       torch.repeat_interleave(torch.arange(2), torch.tensor([20, 12]))])  # (2, 32)
    return q, k, v, weight, ids


def _rank_attention(kv_heads: int) -> dict:
    """On every rank of the cp group (the whole world): this rank's output and gradients of its
    q, k, v positions, by the ring and by the gather, with and without documents."""
    import torch.distributed as dist

    from phalanx.data.batches import chunk_positions
    from phalanx.parallel.context_parallel_attention import ChunkAttention
    from phalanx.parallel.context_parallel_layout import rank_chunks

    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    q, k, v, weight, ids = _inputs(kv_heads)
    mine = chunk_positions(q.shape[2], cp, rank)
    out = {}
    for documents in (None, ids):
        for ring in (True, False):
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            attention = ChunkAttention(rank_chunks(cp, rank), documents, cp, group.group_name, ring)
            part = attention.attend(*local, None)
            grads = torch.autograd.grad((part * weight[:, :, mine]).sum(), local)
            out[(documents is not None, ring)] = (part.detach(), *grads)
    return out


@pytest.mark.parametrize("cp, kv_heads", [(2, 2), (4, 4)])
def test_ring_attention_equals_one_process_with_gradients(cp, kv_heads):
    import torch.nn.functional as F

    from phalanx.data.batches import chunk_positions

    q, k, v, weight, ids = (t.clone() for t in _inputs(kv_heads))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    seq = q.shape[2]
    results = run_ranks(cp, _rank_attention, kv_heads)
    for documents in (None, ids):
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()
        if documents is not None:
            mask = (mask & (documents[:, :, None] == documents[:, None, :]))[:, None]  # (batch, 1, seq, seq)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != q.shape[1])
        ref_all = (ref.detach(), *torch.autograd.grad((ref * weight).sum(), (q, k, v)))
        for ring in (True, False):
            for rank, result in enumerate(results):
                mine = chunk_positions(seq, cp, rank)
                for got, expected in zip(result[(documents is not None, ring)], ref_all):
                    torch.testing.assert_close(got, expected[:, :, mine], atol=TOLERANCE, rtol=TOLERANCE)


def _ring_trace() -> list[tuple[str, int, int]]:
    """On every rank of a cp=4 group: the `cp ring:` steps of one attention forward and backward,
    (name, start, end) in start order."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from phalanx.data.batches import chunk_positions
    from phalanx.parallel.context_parallel_attention import ChunkAttention
    from phalanx.parallel.context_parallel_layout import rank_chunks

    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    q, k, v, weight, _ = _inputs(4)
    mine = chunk_positions(q.shape[2], cp, rank)
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        part = ChunkAttention(rank_chunks(cp, rank), None, cp, group.group_name, True).attend(*local, None)
        (part * weight[:, :, mine]).sum().backward()
    steps = [(e.name, e.time_range.start, e.time_range.end) for e in trace.events() if e.name.startswith("cp ring: ")]
    return sorted(steps, key=lambda step: step[1])


def test_ring_passes_the_next_keys_and_gradients_while_attention_computes():
    """cp=4, forward: at each of the first 3 steps the keys and values at hand are passed on
    before their blocks compute, and the next ones waited for only after; the last step passes
    nothing. Backward: each step's partial key/value gradients are passed on, and the next
    step's gradient blocks computed before that pass is waited for. A transfer waited for at
    once, or issued after the blocks, breaks the order; so does a ring of the wrong length."""
    blocks, wait_kv = "cp ring: blocks of the keys at hand", "cp ring: wait for the next keys/values"
    grad_blocks, wait_grad = "cp ring: gradient blocks of one rank's keys", "cp ring: wait for the key/value gradients"
    forward = ["cp ring: pass keys/values on", blocks, wait_kv] * 3 + [blocks]
    backward = [grad_blocks, "cp ring: pass key/value gradients on"] + [grad_blocks, wait_grad,
                                                                        "cp ring: pass key/value gradients on"] * 2
    backward += [grad_blocks, wait_grad]
    for steps in run_ranks(4, _ring_trace):
        names = [name for name, _, _ in steps]
        assert names == forward + backward, names
        assert all(a[2] <= b[1] for a, b in zip(steps, steps[1:])), "a step runs inside another"


@pytest.mark.parametrize("plan, model, message", [
    ("dp=2,cp_ring=true", "tiny", "cp_ring=true needs cp > 1"),
    ("cp=2,cp_ring=true", "tiny-dsv3", "cp_ring=true does not run latent attention (model 'tiny-dsv3')"),
])
def test_bad_ring_plans_are_refused_in_one_line(plan, model, message):
    from phalanx.model.by_name import model_config
    from phalanx.plan import plan_from_string
    from phalanx.plan_model_checks import validate_for_model

    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_for_model(plan_from_string(plan, 2), model_config(model), global_batch=4, seq_len=32)
