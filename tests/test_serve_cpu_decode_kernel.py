"""The CPU decode-attention kernel (cpu_ops/decode_kernel.py), which reads each sequence's
keys straight from the paged pool, against each sequence's exact keys gathered and scored by
`scaled_dot_product_attention`.

Tolerance 1e-5 on outputs of size O(1) (unit-variance keys and values): both compute the same
softmax-weighted sum in float32, in another order (the kernel sums each dot product and each
weighted value in its own order, the flash kernel in blocked products), ~1e-7 apart. A wrong
slot, a key outside the window or of another sequence, or a query head under the wrong kv head
moves the output by O(0.1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phalanx.cpu_ops import decode_kernel as cpu_decode_kernel

TOL = 1e-5
SLOTS = 512


def _case(counts: list[int], window: int, kv_heads: int, group: int, dim: int, channels: int, seed: int = 0):
    """A pool of SLOTS rows (every kv head's keys, then values); each sequence's positions on
    scattered slots; its query; the first key each sequence sees."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(SLOTS, kv_heads * (dim + channels), generator=gen)
    k_pool = pool[:, :kv_heads * dim].unflatten(-1, (kv_heads, dim))  # strided views, as the cache hands them
    v_pool = pool[:, kv_heads * dim:].unflatten(-1, (kv_heads, channels))
    order = torch.randperm(SLOTS, generator=gen)
    slots = torch.zeros(len(counts), max(counts) + 3, dtype=torch.long)  # wider than needed: only [first, end) is read
    at = 0
    for row, count in enumerate(counts):
        slots[row, :count] = order[at:at + count]
        at += count
    ends = torch.tensor(counts)
    first = (ends - window).clamp(min=0) if window else torch.zeros_like(ends)
    q = torch.randn(len(counts), kv_heads, group, dim, generator=gen)
    return q, k_pool, v_pool, slots, first, ends


def _exact(q, k_pool, v_pool, slots, first, ends, scale):
    """Each sequence alone: its visible slots only, every query head against its kv head."""
    out = []
    for row in range(q.shape[0]):
        mine = slots[row, int(first[row]):int(ends[row])]
        keys, values = k_pool[mine].transpose(0, 1), v_pool[mine].transpose(0, 1)  # (kv_heads, keys, channels)
        out.append(F.scaled_dot_product_attention(q[row], keys, values, scale=scale))
    return torch.stack(out)  # (n, kv_heads, group, channels)


@pytest.mark.parametrize("counts,window,kv_heads,group,dim,channels", [
    ([9], 0, 2, 3, 16, 16),
    ([40, 1, 17, 2], 0, 2, 3, 16, 16),
    ([33, 32, 5, 60, 48, 12, 7], 0, 4, 1, 32, 32),
    ([40, 3, 17, 25], 8, 2, 2, 16, 16),
    ([30, 7, 19], 0, 2, 2, 16, 24),
], ids=["one", "gqa", "mha", "window", "value-channels"])
def test_kernel_equals_each_sequence_alone(counts, window, kv_heads, group, dim, channels):
    """One sequence, several of mixed lengths (one key only, too), query heads one or three per
    kv head, a sliding window that hides each row's oldest keys, values wider than keys."""
    assert cpu_decode_kernel.usable(torch.device("cpu"), torch.float32), "the kernel did not build here"
    args = _case(counts, window, kv_heads, group, dim, channels)
    scale = dim ** -0.5
    most = int((args[-1] - args[-2]).max())
    torch.testing.assert_close(cpu_decode_kernel.attend(*args, most, scale), _exact(*args, scale), rtol=TOL, atol=TOL)


def test_not_for_other_devices_or_dtypes():
    """bf16 pools and other devices decode through the gather and the flash kernel."""
    assert not cpu_decode_kernel.usable(torch.device("cpu"), torch.bfloat16)
    assert not cpu_decode_kernel.usable(torch.device("meta"), torch.float32)


def test_rows_of_another_stride_are_refused():
    """Values whose rows lie another distance apart than the keys': the kernel walks both with
    one stride, so it would read the wrong rows."""
    q, k_pool, _, slots, first, ends = _case([5, 9], 0, 2, 2, 16, 16)
    other = torch.randn(SLOTS, 48)[:, 16:].unflatten(-1, (2, 16))  # rows 48 apart, the keys' 64
    with pytest.raises(ValueError, match="one row stride"):
        cpu_decode_kernel.attend(q, k_pool, other, slots, first, ends, 9, 0.25)


def test_without_a_compiler_decodes_gather_after_one_warning(monkeypatch, tmp_path, capsys):
    """No working C compiler (CC=false) and nothing cached: a warning once on stderr, the
    kernel reported unusable (the cache then gathers), and no second attempt."""
    monkeypatch.setattr(cpu_decode_kernel, "_function", None)
    monkeypatch.setattr(cpu_decode_kernel, "_failure", None)
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("PHALANX_CACHE_DIR", str(tmp_path))
    assert not cpu_decode_kernel.usable(torch.device("cpu"), torch.float32)
    assert not cpu_decode_kernel.usable(torch.device("cpu"), torch.float32)
    err = capsys.readouterr().err
    assert err.count("the CPU decode-attention kernel is not available (false failed") == 1, err
    assert not list(tmp_path.rglob("*.so"))
