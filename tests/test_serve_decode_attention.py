"""Decode attention read from the paged pool (serve/decode_attention.py), compiled, against
each sequence's exact keys gathered and scored by `scaled_dot_product_attention`.

Tolerance 1e-5 on outputs of size O(1) (random unit-variance keys and values): both compute
the same softmax-weighted sum in float32, in another order (a sum over the head dimension and
over keys in the compiled loops, blocked matmuls in the flash kernel), ~1e-7 apart. A wrong
slot, a padded key that leaks through the mask, or a query head under the wrong kv head moves
the output by O(0.1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phalanx.serve import decode_attention

TOL = 1e-5
KV_HEADS, GROUP, DIM, SLOTS = 2, 3, 16, 256


def _case(counts: list[int], window: int, dtype=torch.float32, seed: int = 0):
    """A pool of SLOTS rows; each sequence's positions on scattered slots; its query."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(SLOTS, 2 * KV_HEADS * DIM, generator=gen).to(dtype)
    k_pool = pool[:, :KV_HEADS * DIM].unflatten(-1, (KV_HEADS, DIM))  # strided views, as the cache hands them
    v_pool = pool[:, KV_HEADS * DIM:].unflatten(-1, (KV_HEADS, DIM))
    order = torch.randperm(SLOTS, generator=gen)
    longest = max(counts)
    slots = torch.zeros(len(counts), longest, dtype=torch.long)  # padding reads slot 0, masked
    at = 0
    for row, count in enumerate(counts):
        slots[row, :count] = order[at:at + count]
        at += count
    key = torch.arange(longest)[None, :]
    ends = torch.tensor(counts)[:, None]
    visible = (key < ends) & ((key >= ends - window) if window else True)
    q = torch.randn(len(counts), KV_HEADS, GROUP, DIM, generator=gen).to(dtype)
    return q, k_pool, v_pool, slots, visible


def _exact(q, k_pool, v_pool, slots, visible, scale):
    """Each sequence alone: its visible slots only, every query head against its kv head."""
    out = []
    for row in range(q.shape[0]):
        mine = slots[row][visible[row]]
        keys = k_pool[mine].float().transpose(0, 1)  # (kv_heads, keys, dim)
        values = v_pool[mine].float().transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[row].float(), keys, values, scale=scale))
    return torch.stack(out)  # (n, kv_heads, group, dim)


@pytest.mark.parametrize("counts,window", [([9], 0), ([40, 3, 17], 0), ([33, 32, 1, 60, 5, 48, 12], 0),
                                           ([40, 3, 17, 25], 8)], ids=["one", "three", "seven", "window"])
def test_compiled_equals_each_sequence_alone(counts, window):
    """One sequence (its own compiled graph), several of mixed lengths padded to the longest,
    and a sliding window that hides each row's oldest keys."""
    args = _case(counts, window)
    scale = DIM ** -0.5
    found = decode_attention.compiled_attend(*args, scale)
    assert found is not None and not decode_attention.failed()
    torch.testing.assert_close(found, _exact(*args, scale), rtol=TOL, atol=TOL)


def test_bf16_pool_accumulates_in_float32():
    """A bf16 pool and query: the sums run in float32 and only the result is rounded to bf16,
    so it is the float32 result of the bf16 inputs within bf16's rounding (2^-8 relative)."""
    args = _case([30, 7, 19], 0, dtype=torch.bfloat16)
    found = decode_attention.compiled_attend(*args, DIM ** -0.5)
    assert found.dtype == torch.bfloat16
    torch.testing.assert_close(found.float(), _exact(*args, DIM ** -0.5), rtol=2 ** -8, atol=2 ** -8)


def test_a_failed_compile_falls_back_once_with_a_warning(monkeypatch, capsys):
    """Compiling that raises (no C++ compiler, say): a warning once on stderr, None (the
    caller gathers), and the kernel is not tried again."""
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(decode_attention, "_compiled", broken)
    monkeypatch.setattr(decode_attention, "_failed", False)
    args = _case([5, 9], 0)
    assert decode_attention.compiled_attend(*args, 0.25) is None
    assert decode_attention.compiled_attend(*args, 0.25) is None
    assert calls == [1] and decode_attention.failed()
    assert not decode_attention.enabled(torch.device("cpu"))
    assert capsys.readouterr().err.count("compiling decode attention failed (RuntimeError: no compiler here)") == 1
