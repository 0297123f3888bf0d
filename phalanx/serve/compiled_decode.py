"""`phalanx serve --compile`: the decode steps through one `torch.compile`d graph (inductor).

A decode step (one new token per sequence) is the same short program at every batch size, so
it is compiled once, with the batch dimension symbolic (one graph for every batch of two or
more; a batch of one is padded to two by repeating its row, which writes the same keys to the
same slot and reads the same logits). For dynamo to trace the step whole, without a guard on
Python values that change every step, the cache it sees holds tensors only
(`TensorDecodeCache`: positions, write slots, each sequence's slots and key range), and the
two things no compiler writes are opaque ops: the KV write into the layer's pool, in place
(`phalanx::paged_write`), and the C decode kernel reading the pool (`phalanx::paged_decode`,
`cpu_ops/decode_kernel.py`). Inductor fuses the rest (norms, rotary, SiLU, residual adds) into
its C++ loops, and with the weights frozen into the graph and the batch symbolic it runs the
linears as oneDNN products on packed weights, from C++.

Measured by `benchmarks/compile_decode_step.py` (the eager step, this path, alternated): a few
percent on this CPU, not more, because a decode step's time is mostly its GEMMs' weight reads.
The price: the first decode compiles (tens of seconds; inductor keeps its cache on disk for
the next start), and the packed weights are one more copy of the model's matrices. So it is
opt-in. Prompt chunks stay eager (their per-chunk attention is Python over lists).

Where it does not apply, decodes stay eager and one line says why: a device other than the
CPU, a dtype other than float32, no C decode kernel, tensor-parallel (DTensor) weights,
experts (their rows per expert change every step), latent attention or a sliding window.
"""

from __future__ import annotations

import sys
import time

import torch

from phalanx.cpu_ops import decode_kernel
from phalanx.serve.paged_cache import ChunkLayout, PagedKVCache


@torch.library.custom_op("phalanx::paged_write", mutates_args=("pool",))
def paged_write(pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The new tokens' keys and values, (n, kv_heads, 1, channels) each, into rows `slots` of
    the layer's pool (slots, key channels + value channels), in place (`PagedKVCache.write`)."""
    n = slots.shape[0]
    pool.index_copy_(0, slots, torch.cat([k.reshape(n, -1), v.reshape(n, -1)], 1))


@torch.library.custom_op("phalanx::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, first: torch.Tensor, ends: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """The C kernel over the layer's pool: q (n, kv_heads, group, head_dim), keys and values of
    head_dim channels each -> (n, kv_heads, group, head_dim)."""
    kv_heads, dim = q.shape[1], q.shape[3]
    k_pool = pool[:, :kv_heads * dim].unflatten(-1, (kv_heads, dim))
    v_pool = pool[:, kv_heads * dim:].unflatten(-1, (kv_heads, dim))
    return decode_kernel.attend(q, k_pool, v_pool, slots, first, ends, int((ends - first).max()), scale)


@paged_decode.register_fake
def _(q, pool, slots, first, ends, scale):
    return torch.empty_like(q)


class TensorDecodeCache:
    """The AttentionCache protocol (`model/kv_cache.py`) for one decode step, in tensors only:
    `update` writes the layer's new keys and values and hands back its pool (twice: keys and
    values share its rows) with itself as the attention, whose `attend` runs the kernel."""

    def __init__(self, pools: dict[int, torch.Tensor], positions: torch.Tensor, write: torch.Tensor,
                 slots: torch.Tensor, ends: torch.Tensor):
        self.pools, self._positions, self.write, self.slots, self.ends = pools, positions, write, slots, ends
        self.first = torch.zeros_like(ends)  # no sliding window: every sequence sees all its keys

    def positions(self, seq: int, device) -> torch.Tensor:
        return self._positions  # (n, 1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int):
        paged_write(self.pools[layer], self.write, k, v)
        return self.pools[layer], self.pools[layer], self

    def attend(self, q: torch.Tensor, pool: torch.Tensor, _: torch.Tensor, scale: float | None) -> torch.Tensor:
        n, heads, _, dim = q.shape
        kv_heads = pool.shape[1] // (2 * dim)
        folded = q.reshape(n, kv_heads, heads // kv_heads, dim)  # (n, kv_heads, group, head_dim)
        out = paged_decode(folded, pool, self.slots, self.first, self.ends, dim ** -0.5 if scale is None else scale)
        return out.reshape(n, heads, 1, dim)

    def advance(self, seq: int) -> None:
        pass


def why_not(model: torch.nn.Module, cache: PagedKVCache) -> str | None:
    """Why this model's decodes cannot take the compiled step, or None: they can."""
    cfg = getattr(model, "cfg", None)
    weight = next(model.parameters())
    if cache.device.type != "cpu" or not cache.pool_kernel:
        return "the compiled step reads the pool with the CPU decode kernel (float32 on the CPU, a C compiler)"
    if weight.dtype != torch.float32:
        return f"the compiled step is float32 only, the model is {weight.dtype}"
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return "tensor-parallel (DTensor) weights are not compiled"
    if cfg is None or cfg.n_experts or cfg.is_latent or cfg.sliding_window:
        return "experts, latent attention and sliding windows are not compiled"
    return None


class CompiledDecode:
    """The model's decode forward compiled once; called with the prepared paged cache."""

    def __init__(self, model: torch.nn.Module):
        # freezing: the weights become constants of the graph, which lets inductor pack them
        # for oneDNN (it does for a symbolic batch; for a fixed one in fp32 it picks MKL's sgemm,
        # slower on these CPUs: benchmarks/compile_decode_step.py).
        self.forward = torch.compile(model, fullgraph=True, dynamic=True)
        self.freezing = torch._inductor.config.patch(freezing=True)

    def __call__(self, tokens: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """tokens (n, 1) of a decode step the cache was prepared for -> logits (n, 1, vocab)."""
        read = cache.pool_read_rows()
        n = tokens.shape[0]
        state = (tokens, read.positions, read.write, read.slots, read.ends)
        if n == 1:  # a batch of one would be its own graph: repeat the row instead
            state = tuple(tensor.expand(2, *tensor.shape[1:]).contiguous() for tensor in state)
        tokens, positions, write, slots, ends = state
        with self.freezing:  # read when it compiles
            return self.forward(tokens, TensorDecodeCache(cache.pools, positions, write, slots, ends))[:n]


def compiled_decode(model: torch.nn.Module, cache: PagedKVCache) -> CompiledDecode | None:
    """The compiled decode step for `phalanx serve --compile`, compiled now (before the server
    says it serves, so that no request waits for it), or None: decodes stay eager, and a line
    on stderr says why."""
    reason = why_not(model, cache)
    if reason is not None:
        print(f"phalanx: --compile: decodes stay eager: {reason}", file=sys.stderr, flush=True)
        return None
    print("phalanx: --compile: compiling the decode step (tens of seconds the first time; inductor caches it on disk)",
          file=sys.stderr, flush=True)
    began = time.monotonic()
    compiled = CompiledDecode(model)
    warm_up(compiled, model, cache)
    print(f"phalanx: --compile: decode step compiled in {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
    return compiled


@torch.no_grad()
def warm_up(compiled: CompiledDecode, model: torch.nn.Module, cache: PagedKVCache) -> None:
    """One token and a decode after it through block 0, which no sequence holds yet: the
    first makes every layer's pool, the second compiles the step. What they leave in block 0
    is never read: a sequence reads only positions it wrote itself."""
    token = torch.zeros((1, 1), dtype=torch.long, device=cache.device)
    for start in (0, 1):
        cache.prepare([ChunkLayout([0], start, 1)])
        (compiled if start else model)(token, cache)
