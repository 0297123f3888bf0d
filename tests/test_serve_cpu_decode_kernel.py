"""The CPU decode-attention kernel (cpu_ops/decode_kernel.py), which reads each sequence's
keys straight from the paged pool, against each sequence's exact keys gathered and scored by
`scaled_dot_product_attention`.

Tolerance 1e-5 on outputs of size O(1) (unit-variance keys and values): both compute the same
softmax-weighted sum in float32, in another order (the kernel sums each dot product and each
weighted value in its own order, the flash kernel in blocked products), ~1e-7 apart. A wrong
slot, a key outside the window or of another sequence, or a query head under the wrong kv head
moves the output by O(0.1).

A bfloat16 pool: the kernel widens each key and value to float32 as it reads it, so it equals
SDPA in float32 over the same values widened (1e-5, as above) before its output is rounded to
bfloat16 (compared then within one bfloat16 step, 2^-8 relative, of that reference rounded).
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


@pytest.mark.parametrize("counts,window,kv_heads,group,dim,channels", [
    ([40, 1, 17, 2], 0, 2, 3, 16, 16),
    ([40, 3, 17, 25], 8, 2, 2, 16, 16),
    ([30, 7, 19], 0, 2, 2, 16, 24),
], ids=["gqa", "window", "value-channels"])
def test_a_bfloat16_pool_is_read_widened(counts, window, kv_heads, group, dim, channels):
    assert cpu_decode_kernel.usable(torch.device("cpu"), torch.bfloat16), "the kernel did not build here"
    q, k_pool, v_pool, slots, first, ends = _case(counts, window, kv_heads, group, dim, channels)
    pool = torch.cat([k_pool.flatten(1), v_pool.flatten(1)], 1).to(torch.bfloat16)  # one bf16 pool, as the cache's
    k16 = pool[:, :kv_heads * dim].unflatten(-1, (kv_heads, dim))
    v16 = pool[:, kv_heads * dim:].unflatten(-1, (kv_heads, channels))
    q16, scale, most = q.to(torch.bfloat16), dim ** -0.5, int((ends - first).max())
    out = cpu_decode_kernel.attend(q16, k16, v16, slots, first, ends, most, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (len(counts), kv_heads, group, channels)
    widened = _exact(q16.float(), k16.float(), v16.float(), slots, first, ends, scale)
    torch.testing.assert_close(out, widened.to(torch.bfloat16), rtol=2 ** -8, atol=TOL)
    torch.testing.assert_close(cpu_decode_kernel.attend(q16.float(), k16, v16, slots, first, ends, most, scale),
                               widened, rtol=TOL, atol=TOL)  # a float32 query: the float32 result, unrounded


def test_not_for_other_devices_or_dtypes():
    """float16 pools and other devices decode through the gather and the flash kernel."""
    assert not cpu_decode_kernel.usable(torch.device("cpu"), torch.float16)
    assert not cpu_decode_kernel.usable(torch.device("meta"), torch.float32)
    q, k_pool, v_pool, slots, first, ends = _case([5, 9], 0, 2, 2, 16, 16)
    with pytest.raises(ValueError, match="float32 or bfloat16 pools"):
        cpu_decode_kernel.attend(q, k_pool.half(), v_pool.half(), slots, first, ends, 9, 0.25)


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
    monkeypatch.setattr(cpu_decode_kernel, "_functions", None)
    monkeypatch.setattr(cpu_decode_kernel, "_failure", None)
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("PHALANX_CACHE_DIR", str(tmp_path))
    assert not cpu_decode_kernel.usable(torch.device("cpu"), torch.float32)
    assert not cpu_decode_kernel.usable(torch.device("cpu"), torch.float32)
    err = capsys.readouterr().err
    assert err.count("the CPU decode-attention kernel is not available (false failed") == 1, err
    assert not list(tmp_path.rglob("*.so"))


def test_a_bfloat16_engine_decodes_alike_from_the_pool_and_gathered(tmp_path, monkeypatch):
    """`phalanx serve --dtype bf16`'s engine on a random llama: decodes read from the pool by
    the kernel against the same engine gathering them for SDPA (PHALANX_CPU_DECODE_KERNEL=0's
    path), three sequences of mixed lengths, greedy. Both round attention's output to bfloat16
    (the kernel after its float32 sums, SDPA's CPU kernel after its float32 accumulation), so
    the logits may differ by bfloat16 rounding carried through the layers: within 8 bfloat16
    steps of the largest logit (2^-8 relative each; measured: 2-4 steps) up to the first token
    that differs, if one does, and that one at a gap within that tolerance of the gathered
    path's top-2 logits (after it the two feed the model different tokens)."""
    from collections import defaultdict

    import phalanx.hf as hf
    from phalanx.scheduling.scheduler import Scheduler, Sequence
    from phalanx.serve.engine import Engine
    from phalanx.serve.sampling_params import request_sampling
    from tests.hf_models import VOCAB, write_checkpoint

    pytest.importorskip("transformers")
    model = hf.load(write_checkpoint(tmp_path / "hf", "llama")).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    prompts = {name: torch.randint(0, VOCAB, (length,), generator=gen).tolist()
               for name, length in (("a", 9), ("b", 1), ("c", 23))}

    def run(kernel: bool):
        monkeypatch.setattr(cpu_decode_kernel, "ON", kernel)
        seen: dict[str, list[torch.Tensor]] = defaultdict(list)
        scheduler = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_waiting=8)
        engine = Engine(model, scheduler, on_logits=lambda seq, row: seen[seq.seq_id].append(row.float().clone()))
        assert engine.runner.cache.pool_kernel == kernel
        for name, prompt in prompts.items():
            scheduler.add(Sequence.of(name, prompt, 10, params=request_sampling(0, 1, None, 0)))
        while scheduler.has_work():
            engine.step()
        return {name: torch.stack(rows) for name, rows in seen.items()}

    pooled, gathered = run(True), run(False)
    for name in prompts:
        tol = 8 * 2 ** -8 * float(gathered[name].abs().max())
        ours, theirs = pooled[name].argmax(-1).tolist(), gathered[name].argmax(-1).tolist()
        differ = next((step for step, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
        # Up to the first different token (after it the two feed different inputs).
        torch.testing.assert_close(pooled[name][:differ + 1], gathered[name][:differ + 1], rtol=0, atol=tol)
        if differ < len(ours):
            top = gathered[name][differ].topk(2).values
            assert float(top[0] - top[1]) < tol, f"{name} step {differ}: {ours[differ]} against {theirs[differ]}"
