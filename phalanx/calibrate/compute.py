"""What one device computes: matrix multiplies, attention, memory bandwidth, and whole
training steps of the real Transformer (for the fixed per-layer and per-step costs)."""

from __future__ import annotations

import math
import time

from phalanx.calibrate.workers import smoke, sync_device, timeit
from phalanx.model.config import ModelConfig


def measure_matmuls(device, dtype, *, quick: bool) -> list[tuple[int, int, int, float]]:
    """(m, n, k, seconds of arithmetic) for square and skinny products.

    The fixed cost of one call (an 8 x 8 product) is subtracted: it belongs to the per-layer
    overhead, measured separately, not to the throughput.
    """
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch

    tiny = torch.randn(8, 8, device=device, dtype=dtype)
    call = timeit(lambda: (torch.matmul(tiny, tiny), sync_device(device)), repeats=10 if quick else 50, warmup=2,
                   best=True)

    sizes = [32, 64, 128, 256] if quick else [32, 64, 128, 256, 512, 1024, 2048]
    if device.type == "cuda":
        sizes = [s * 4 for s in sizes]
    shapes = [(s, s, s) for s in sizes] + ([] if quick else [(sizes[-1], sizes[-1], s) for s in sizes[:3]])
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        reps = max(5, min(50, int(2e8 / (2 * m * n * k)) + 1)) if not quick else 3

        def run():
            torch.matmul(a, b)
            sync_device(device)

        t = timeit(run, repeats=reps, best=True)
        if t > 3 * call:  # otherwise the call overhead, not the arithmetic, is what was timed
            out.append((m, n, k, t - call))
    return out


def measure_attention(device, dtype, peak: float, *, quick: bool) -> float:
    """Fraction of `peak` that causal attention forward+backward adds per extra FLOP.

    Timed at two sequence lengths so that the fixed cost of the call (already inside
    layer_overhead_us) cancels: efficiency = (FLOPs2 - FLOPs1) / (peak * (t2 - t1)).
    """
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch
    import torch.nn.functional as F

    batch, heads, hd = (1, 4, 32) if device.type == "cpu" else (4, 16, 128)
    seqs = (256, 1024) if device.type == "cpu" else (1024, 4096)
    points = []
    for seq in seqs:
        q, k, v = (torch.randn(batch, heads, seq, hd, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))

        def run():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            sync_device(device)

        # The cost model's count: forward 0.5 * 4 T s h_q, backward 2.5x that.
        flops = 3.5 * 0.5 * 4 * batch * seq * seq * heads * hd
        points.append((flops, timeit(run, repeats=3 if quick else 10, best=True)))
    (f1, t1), (f2, t2) = points
    if t2 <= t1:
        return 1.0
    return min(1.0, (f2 - f1) / (t2 - t1) / peak)


def measure_bandwidth(device, *, quick: bool) -> float:
    """Memory bandwidth in TB/s from c = a + b on large float32 tensors (3 x 4 bytes per element)."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch

    n = (1 << 20) if quick else (1 << 25)
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)
    c = torch.empty_like(a)

    def run():
        torch.add(a, b, out=c)
        sync_device(device)

    return 12 * n / timeit(run, repeats=5 if quick else 20, best=True) / 1e12


OVERHEAD_MODEL = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
"""The real phalanx Transformer timed for the fixed and size-dependent costs of a layer: small
enough that fixed costs show, large enough (at OVERHEAD_TOKENS[1]) that per-token work does."""


OVERHEAD_TOKENS = ((1, 16), (8, 128))
"""(micro-batch, sequence) of the two sizes the layer is timed at."""


def overhead_model(layers: int, seq: int):
    return ModelConfig(name="overhead", n_layers=layers, max_seq_len=seq, **OVERHEAD_MODEL)


def measure_overheads(device, *, quick: bool, threads: tuple[int, ...] = (1,)) -> dict:
    """Whole training steps of the real phalanx Transformer (forward, cross-entropy, backward,
    clipping, AdamW, zeroing: what the trainer's step does) at 1 and 5 layers, at the two sizes
    of OVERHEAD_TOKENS, for each thread count; and at the small size with every block under
    activation checkpointing. Seconds, fastest repeat, keyed "layers:mbs:seq:threads[:rc]".
    """
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch
    from torch.utils.checkpoint import checkpoint

    from phalanx.model.transformer import Transformer

    before = torch.get_num_threads()

    def timed(layers: int, mbs: int, seq: int, recompute: bool, tail_only: bool = False) -> float:
        cfg = overhead_model(layers, seq)
        torch.manual_seed(0)
        model = Transformer(cfg).to(device)
        if recompute:
            for block in model.layers.values():
                block.forward = (lambda f: lambda x, rope: checkpoint(f, x, rope, use_reentrant=False))(block.forward)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, cfg.vocab_size, (mbs, seq), device=device)

        def step():
            logits = model(tokens)
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync_device(device)

        if tail_only:  # clipping, AdamW and zeroing alone, after a backward each time
            times = []
            for i in range(4 if smoke() else 13 if quick else 43):
                model(tokens).float().sum().backward()
                start = time.perf_counter()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= 3:
                    times.append(time.perf_counter() - start)
            return min(times)
        big = mbs * seq > 256
        if smoke():
            return timeit(step, repeats=1, warmup=1, best=True)
        return timeit(step, repeats=(5 if quick else 20) if big else (10 if quick else 40), warmup=3, best=True)

    out = {}
    try:
        # Two rounds, each thread count in turn, keeping each figure's best: a neighbour that
        # holds a core for a while slows whichever thread count is timed then (the all-core
        # timing most), and one round once read a 2-core speedup of 1.16 against 1.5-1.65.
        for _ in range(1 if quick else 2):
            for t in threads:
                torch.set_num_threads(t)
                for mbs, seq in OVERHEAD_TOKENS:
                    for layers in (1, 5):
                        key = f"{layers}:{mbs}:{seq}:{t}"
                        out[key] = min(out.get(key, math.inf), timed(layers, mbs, seq, False))
        torch.set_num_threads(threads[0])
        mbs, seq = OVERHEAD_TOKENS[0]
        for layers in (1, 5):
            out[f"{layers}:{mbs}:{seq}:{threads[0]}:rc"] = timed(layers, mbs, seq, True)
            out[f"{layers}:{mbs}:{seq}:{threads[0]}:tail"] = timed(layers, mbs, seq, False, tail_only=True)
        block = Transformer(overhead_model(1, seq)).layers["0"]
        out["block_params"] = float(sum(p.numel() for p in block.parameters()))
    finally:
        torch.set_num_threads(before)
    return out
