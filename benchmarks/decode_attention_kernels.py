"""Decode attention of a serving step, four ways, on serve_load.py's shapes: why `phalanx serve`
reads the keys straight from the pool with its own C kernel on the CPU.

A step of `--sequences` decodes (key counts drawn from 40-380, serve_load.py's mixed lengths,
seeded), each on scattered blocks of 16 slots, over `--layers` layer pools of 1024 blocks (the
benchmark's --num-kv-blocks; 32 MiB each for its mixtral, 4 kv heads of 64 channels, so the
pools together do not fit the CPU's last-level cache, as while serving). Per layer:
- `gather + flash` (phalanx, the baseline): `PagedKVCache.update` gathers whole slot rows,
  `RaggedAttention` runs `scaled_dot_product_attention` per group of nearly equal length;
- `gather + matmul`: the same gathered keys, scores and weighted values by two matmuls per group;
- `compiled, from pool`: no gather; a `torch.compile`d sum over each group's slots, read where
  they lie in the pool (the rows are crossed once instead of three times).
The ways alternate call by call (a drifting machine hits all); prints the median time of a
step's attention over all layers, its ratio to the baseline, and the largest difference.
`--dtype bf16`: the pools, new keys and queries in bfloat16 (`phalanx serve --dtype bf16`; the C
kernel widens each key as it reads it).

    .venv/bin/python benchmarks/decode_attention_kernels.py [--sequences 32] [--layers 4] [--blocks 1024] [--iterations 40] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phalanx.cpu_ops import decode_kernel as cpu_decode_kernel  # noqa: E402
from phalanx.serve.paged_cache import ChunkLayout, PagedKVCache  # noqa: E402

KV_HEADS, GROUP, DIM, BLOCK = 4, 2, 64, 16


def from_pool(q, k_pool, v_pool, slots, visible, scale: float):
    """q (n, kv_heads, group, dim); k_pool, v_pool (slots, kv_heads, dim) views of the pool;
    slots, visible (n, keys) -> (n, kv_heads, group, dim), summed where inductor reads the rows."""
    keys = k_pool[slots]  # (n, keys, kv_heads, dim)
    scores = (q[:, None] * keys[:, :, :, None, :]).sum(-1) * scale  # (n, keys, kv_heads, group)
    weights = torch.softmax(scores.masked_fill(~visible[:, :, None, None], float("-inf")), dim=1)
    return (weights[..., None] * v_pool[slots][:, :, :, None, :]).sum(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=1024, help="blocks of 16 slots per layer pool")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    rng = random.Random(args.seed)
    counts = [rng.randint(40, 380) for _ in range(args.sequences)]
    needed = sum(-(-count // BLOCK) for count in counts)
    if needed > args.blocks:
        sys.exit(f"--blocks {args.blocks}: the {args.sequences} sequences need {needed} blocks")
    free = list(range(args.blocks))
    rng.shuffle(free)
    tables = []
    for count in counts:
        tables.append([free.pop() for _ in range(-(-count // BLOCK))])
    if not cpu_decode_kernel.usable(torch.device("cpu"), dtype):
        sys.exit("the CPU decode kernel did not build here (a C compiler with OpenMP is needed)")
    cache = PagedKVCache(args.blocks, BLOCK, ragged=True)  # gathers: the baseline
    kernel_cache = PagedKVCache(args.blocks, BLOCK, ragged=True, pool_kernel=True)
    cache.prepare([ChunkLayout(table, count - 1, 1) for table, count in zip(tables, counts)])  # one decode each
    gen = torch.Generator().manual_seed(args.seed)
    new = [torch.randn(2, args.sequences, KV_HEADS, 1, DIM, generator=gen).to(dtype) for _ in range(args.layers)]
    kernel_cache.prepare([ChunkLayout(table, count - 1, 1) for table, count in zip(tables, counts)])
    for layer in range(args.layers):  # every pool filled, then this step's new keys written
        cache.write(layer, *new[layer])
        cache.pools[layer].normal_(generator=gen)
        cache.write(layer, *new[layer])
        kernel_cache.pools[layer] = cache.pools[layer]  # the same pools, read the other way
        kernel_cache._shapes[layer] = cache._shapes[layer]
    q = torch.randn(args.sequences, KV_HEADS * GROUP, 1, DIM, generator=gen).to(dtype)
    folded = q.reshape(args.sequences, KV_HEADS, GROUP, DIM)  # query heads under their kv head
    scale = DIM ** -0.5
    compiled = torch.compile(from_pool, dynamic=True)
    groups = cache.update(0, *new[0], 0)[2].groups
    group_slots, group_visible = [], []  # (n, longest) each, as the cache reads them: padding reads slot 0
    for group in groups:
        rows = []
        for row in group.rows.tolist():
            slots = [block * BLOCK + i for block in tables[row] for i in range(BLOCK)][:counts[row]]
            rows.append(slots + [0] * (group.longest - len(slots)))
        group_slots.append(torch.tensor(rows))
        group_visible.append(torch.arange(group.longest)[None, :] < torch.tensor(group.counts)[:, None])

    def gather_flash(layer):
        k, v, ragged = cache.update(layer, *new[layer], 0)  # writes the same new keys again
        return ragged.attend(q, k, v, None)

    def gather_matmul(layer):
        k, v, _ = cache.update(layer, *new[layer], 0)
        out = folded.new_empty(folded.shape)
        for group, visible in zip(groups, group_visible):
            n, longest = len(group.counts), group.longest
            span = slice(group.key_offset, group.key_offset + n * longest)
            keys = k[0, :, span].view(KV_HEADS, n, longest, -1).transpose(0, 1)  # (n, kv_heads, longest, dim)
            values = v[0, :, span].view(KV_HEADS, n, longest, -1).transpose(0, 1)
            scores = torch.matmul(folded.index_select(0, group.rows), keys.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
            out.index_copy_(0, group.rows, torch.matmul(torch.softmax(scores, -1), values))
        return out.view(q.shape)

    def compiled_from_pool(layer):
        cache.write(layer, *new[layer])
        pool = cache.pools[layer]
        k_pool = pool[:, :KV_HEADS * DIM].unflatten(-1, (KV_HEADS, DIM))  # (slots, kv_heads, dim) views
        v_pool = pool[:, KV_HEADS * DIM:].unflatten(-1, (KV_HEADS, DIM))
        out = folded.new_empty(folded.shape)
        for group, slots, visible in zip(groups, group_slots, group_visible):
            out.index_copy_(0, group.rows, compiled(folded.index_select(0, group.rows), k_pool, v_pool, slots, visible,
                                                    scale))
        return out.view(q.shape)

    def c_kernel(layer):
        k, v, ragged = kernel_cache.update(layer, *new[layer], 0)  # the pools as views, the slots to read
        return ragged.attend(q, k, v, None)

    ways = {"gather + flash": gather_flash, "gather + matmul": gather_matmul,
            "compiled, from pool": compiled_from_pool, "C kernel, from pool (phalanx)": c_kernel}
    torch.set_grad_enabled(False)
    reference = [gather_flash(layer) for layer in range(args.layers)]
    differences = {name: max(float((way(layer) - reference[layer]).abs().max()) for layer in range(args.layers))
                   for name, way in ways.items()}  # also compiles and warms
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.iterations):
        for name, way in ways.items():
            began = time.perf_counter()
            for layer in range(args.layers):
                way(layer)
            times[name].append(time.perf_counter() - began)
    base = statistics.median(times["gather + flash"])
    print(f"{args.sequences} decodes ({sum(counts)} keys), {args.layers} layer pools of {args.blocks} blocks of {BLOCK} "
          f"({cache.pools[0].numel() * cache.pools[0].element_size() / 2**20:.0f} MiB each, {args.dtype}), "
          f"{torch.get_num_threads()} threads; "
          f"median of {args.iterations} alternating steps")
    print(f"{'way':30} {'ms/step':>8} {'gather + flash / way':>21} {'max diff':>9}")
    for name in ways:
        median = statistics.median(times[name])
        print(f"{name:30} {median * 1e3:>8.2f} {base / median:>20.2f}x {differences[name]:>9.1e}")


if __name__ == "__main__":
    main()
