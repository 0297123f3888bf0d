"""Measure this machine and write the cluster file that `--cluster local` reads.

What is measured, and which Cluster field it sets:
  matrix multiplies over a range of shapes -> peak_tflops and matmul_half_dim (least-squares
    fit of t = 2mnk / (peak f(m) f(n) f(k) wave), f(d) = d / (d + half), wave the SMs' wave
    fill on a GPU, sm_count read off the device), matmul_efficiency = 1;
  causal scaled-dot-product attention forward+backward -> attention_efficiency;
  a large element-wise add -> hbm_tbs (memory bandwidth);
  training steps of a model too small for its FLOPs to count, at two depths ->
    layer_overhead_us (slope) and step_overhead_ms (intercept: loss, clipping, AdamW);
  FSDP2 on 2 gloo processes, with and without sharding, at two depths ->
    fsdp_unit_overhead_us (framework cost per sharded layer per micro-batch); the same with
    phalanx's own tensor-parallel plan (apply_tp) at 8 tokens and at a real micro-batch, with
    and without sequence parallelism -> tp_layer_overhead_us (DTensor dispatch per pass),
    tp_element_overhead_ns (what grows with the activation) and sp_layer_overhead_us;
  DDP, FSDP under pipeline parallelism and the pipeline runtime on the trainer's own code
    paths (CPU only; see calibrate_runtime.py) -> ddp_step_overhead_ms per group size,
    fsdp_pp_unit_overhead_us, fsdp_pp_microbatch_overhead_us, pp_action_overhead_us per schedule;
  all-reduce and all-gather over 2..max_procs processes with the real backend (gloo on CPU,
    NCCL on GPU) at several sizes -> alpha (latency) and beta (bandwidth) per group size by a
    linear fit; their medians become intra_latency_us and intra_bw_gbs.
On a CPU, `cores` concurrent single-threaded matmul workers then measure the share of the
machine the job really gets over time (the figures above keep their fastest repeat); peak
and bandwidth are multiplied, the fixed costs divided, by that share.
Every figure is printed, and the per-group-size fits are saved beside the cluster file.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import statistics
import time
from pathlib import Path

from phalanx.errors import UserError
from phalanx.planner.cost import wave_fill
from phalanx.planner.hardware import Cluster, local_cluster_path


def _timeit(fn, *, repeats: int, warmup: int = 1, best: bool = False) -> float:
    """Median (or, for what the hardware can do on a shared machine, fastest) seconds of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) if best else statistics.median(times)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_matmuls(device, dtype, *, quick: bool) -> list[tuple[int, int, int, float]]:
    """(m, n, k, seconds of arithmetic) for square and skinny products.

    The fixed cost of one call (an 8 x 8 product) is subtracted: it belongs to the per-layer
    overhead, measured separately, not to the throughput.
    """
    import torch

    tiny = torch.randn(8, 8, device=device, dtype=dtype)
    call = _timeit(lambda: (torch.matmul(tiny, tiny), _sync(device)), repeats=10 if quick else 50, warmup=2,
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
            _sync(device)

        t = _timeit(run, repeats=reps, best=True)
        if t > 3 * call:  # otherwise the call overhead, not the arithmetic, is what was timed
            out.append((m, n, k, t - call))
    return out


def fit_matmul(samples: list[tuple[int, int, int, float]], sm_count: int = 0) -> tuple[float, float]:
    """(peak FLOP/s, half_dim) minimising the squared log error of the fill model.

    On a GPU the cost model also charges wave quantization over `sm_count` SMs
    (cost.wave_fill), so the fit divides it out first rather than let half_dim absorb it.
    """
    best = None
    waves = [wave_fill(m, n, sm_count) for m, n, _, _ in samples]
    for half in [0.0] + [2.0 ** (i / 4) for i in range(0, 48)]:
        fills = [(m / (m + half)) * (n / (n + half)) * (k / (k + half)) * w
                 for (m, n, k, _), w in zip(samples, waves)]
        # For a fixed half, the best log-peak is the mean of log(achieved / fill).
        logs = [math.log(2 * m * n * k / t / f) for (m, n, k, t), f in zip(samples, fills)]
        log_peak = statistics.fmean(logs)
        err = sum((x - log_peak) ** 2 for x in logs)
        if best is None or err < best[0]:
            best = (err, math.exp(log_peak), half)
    return best[1], best[2]


def measure_attention(device, dtype, peak: float, *, quick: bool) -> float:
    """Fraction of `peak` that causal attention forward+backward adds per extra FLOP.

    Timed at two sequence lengths so that the fixed cost of the call (already inside
    layer_overhead_us) cancels: efficiency = (FLOPs2 - FLOPs1) / (peak * (t2 - t1)).
    """
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
            _sync(device)

        # The cost model's count: forward 0.5 * 4 T s h_q, backward 2.5x that.
        flops = 3.5 * 0.5 * 4 * batch * seq * seq * heads * hd
        points.append((flops, _timeit(run, repeats=3 if quick else 10, best=True)))
    (f1, t1), (f2, t2) = points
    if t2 <= t1:
        return 1.0
    return min(1.0, (f2 - f1) / (t2 - t1) / peak)


def measure_bandwidth(device, *, quick: bool) -> float:
    """Memory bandwidth in TB/s from c = a + b on large float32 tensors (3 x 4 bytes per element)."""
    import torch

    n = (1 << 20) if quick else (1 << 25)
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)
    c = torch.empty_like(a)

    def run():
        torch.add(a, b, out=c)
        _sync(device)

    return 12 * n / _timeit(run, repeats=5 if quick else 20, best=True) / 1e12


OVERHEAD_MODEL = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
"""The real phalanx Transformer timed for the fixed and size-dependent costs of a layer: small
enough that fixed costs show, large enough (at OVERHEAD_TOKENS[1]) that per-token work does."""
OVERHEAD_TOKENS = ((1, 16), (8, 128))
"""(micro-batch, sequence) of the two sizes the layer is timed at."""


def overhead_model(layers: int, seq: int):
    from phalanx.model.config import ModelConfig

    return ModelConfig(name="overhead", n_layers=layers, max_seq_len=seq, **OVERHEAD_MODEL)


def measure_overheads(device, *, quick: bool, threads: tuple[int, ...] = (1,)) -> dict:
    """Whole training steps of the real phalanx Transformer (forward, cross-entropy, backward,
    clipping, AdamW, zeroing: what the trainer's step does) at 1 and 5 layers, at the two sizes
    of OVERHEAD_TOKENS, for each thread count; and at the small size with every block under
    activation checkpointing. Seconds, fastest repeat, keyed "layers:mbs:seq:threads[:rc]".
    """
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
            _sync(device)

        if tail_only:  # clipping, AdamW and zeroing alone, after a backward each time
            times = []
            for i in range(13 if quick else 43):
                model(tokens).float().sum().backward()
                start = time.perf_counter()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= 3:
                    times.append(time.perf_counter() - start)
            return min(times)
        big = mbs * seq > 256
        return _timeit(step, repeats=(5 if quick else 20) if big else (10 if quick else 40), warmup=3, best=True)

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


def fit_layer_terms(per_layer: tuple[float, float], flops_s: tuple[float, float],
                    elementwise_s: tuple[float, float]) -> tuple[float, float]:
    """(overhead seconds per layer per pass, fraction of the bandwidth element-wise work reaches)
    from one layer's measured training-step seconds at two sizes.

    The cost model charges a layer F + B + W = flops_s (GEMMs, attention: calibrated on their
    own) + elementwise_s / efficiency (memory-bound passes) + 3 x overhead (fixed, per pass).
    Two sizes give two equations: the growth not explained by the FLOPs is element-wise work,
    what is left at the small size is fixed cost.
    """
    (d1, d2), (g1, g2), (e1, e2) = per_layer, flops_s, elementwise_s
    rest1, rest2 = d1 - g1, d2 - g2
    efficiency = 1.0
    if rest2 > rest1 and e2 > e1:
        efficiency = min(1.0, max(1e-3, (e2 - e1) / (rest2 - rest1)))
    overhead = max(0.0, (rest1 - e1 / efficiency) / 3)
    return overhead, efficiency


def fit_overheads(samples: dict, cluster: Cluster, cores: int) -> dict:
    """Per-layer overhead, element-wise efficiency, step overhead, recompute overhead and the
    thread speedup from measure_overheads' samples, against `cluster`'s FLOP and bandwidth
    figures (one thread per rank, world = cores: as measured)."""
    from phalanx.planner.cost import layer_cost

    from phalanx.planner.cost import CLIP_BYTES_PER_PARAM, GRAD_ZERO_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM

    (m1, s1), (m2, s2) = OVERHEAD_TOKENS
    slope = lambda mbs, seq, t, rc="": (samples[f"5:{mbs}:{seq}:{t}{rc}"] - samples[f"1:{mbs}:{seq}:{t}{rc}"]) / 4  # noqa: E731
    peak, bw = cluster.peak_flops_per_rank(cores), cluster.memory_bw_per_rank(cores)
    # Clipping, AdamW and zeroing of one layer's parameters run once per step, not per
    # micro-batch: take them out of the per-layer slope; beyond their bytes (which the cost
    # model charges already) they are a fixed cost per layer per step.
    tail = max(0.0, slope(m1, s1, 1, ":tail")) if f"1:{m1}:{s1}:1:tail" in samples else 0.0
    tail_bytes = samples.get("block_params", 0.0) * (OPTIMIZER_BYTES_PER_PARAM + CLIP_BYTES_PER_PARAM
                                                     + GRAD_ZERO_BYTES_PER_PARAM) / bw
    d = (slope(m1, s1, 1) - tail, slope(m2, s2, 1) - tail)
    flops, elementwise, forward = [], [], []
    for mbs, seq in OVERHEAD_TOKENS:
        kw = dict(seq=seq, mbs=mbs, tp=1, ep=1, sp=False, moe=False, peak=peak, flash=True, overhead=0.0)
        model = overhead_model(1, seq)
        fast = layer_cost.__wrapped__(model, cluster, memory_bw=float("inf"), **kw)
        slow = layer_cost.__wrapped__(model, cluster, memory_bw=bw, **kw)
        g = fast.f + fast.b + fast.w
        flops.append(g)
        elementwise.append(slow.f + slow.b + slow.w - g)
        forward.append((fast.f, slow.f - fast.f))  # (FLOP, element-wise) seconds of the forward
    overhead, efficiency = fit_layer_terms(d, tuple(flops), tuple(elementwise))
    step = max(0.0, samples[f"1:{m1}:{s1}:1"] - d[0] - tail)
    # The checkpointed step's extra per layer, less the re-run forward the cost model charges
    # on its own (FLOPs, element-wise passes, one pass's fixed cost) and the once-per-step
    # optimizer work that the checkpointed timings include as well.
    rerun = forward[0][0] + forward[0][1] / efficiency + overhead
    recompute = max(0.0, slope(m1, s1, 1, ":rc") - tail - d[0] - rerun)
    speedup = 0.0
    if f"1:{m2}:{s2}:{cores}" in samples and cores > 1:
        one = d[1] - d[0]
        many = slope(m2, s2, cores) - slope(m1, s1, cores)
        speedup = min(float(cores), max(1.0, one / many)) if many > 0 and one > 0 else 1.0
    return {"layer_overhead_us": overhead * 1e6, "elementwise_efficiency": efficiency,
            "step_overhead_ms": step * 1e3, "recompute_overhead_us": recompute * 1e6, "thread_speedup": speedup,
            "optimizer_layer_overhead_us": max(0.0, tail - tail_bytes) * 1e6,
            "per_layer_s": d, "flops_s": flops, "elementwise_s": elementwise}


def init_worker(rank: int, world: int, port: int, threads: int, backend: str = "gloo"):
    """A measurement worker's start: its thread count, the environment the trainer's code
    reads (RANK, WORLD_SIZE, ...), a process group with a short timeout. Returns torch, dist."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    return torch, dist


def _collective_worker(rank: int, world: int, port: int, backend: str, sizes: list[int], repeats: int,
                       threads: int, queue) -> None:
    torch, dist = init_worker(rank, world, port, threads, backend)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    results = {}
    for op in ("all_reduce", "all_gather"):
        for nbytes in sizes:
            numel = max(1, nbytes // 4)
            x = torch.ones(numel, device=device)
            outs = [torch.empty_like(x) for _ in range(world)]
            times = []
            for i in range(repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(x)
                else:
                    dist.all_gather(outs, x)
                _sync(device)
                if i:
                    times.append(time.perf_counter() - start)
            # The fastest repeat: a woken gloo thread sometimes waits a scheduler slice (ms) for
            # a core, which the DDP and pipeline measurements charge where it happens.
            results[f"{op}:{numel * 4}"] = min(times)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def _fsdp_worker(rank: int, world: int, port: int, repeats: int, threads: int, queue) -> None:
    """Per-unit, per-micro-batch cost of FSDP2 beyond its collectives' bytes."""
    _wrapper_overhead_worker(rank, world, port, repeats, threads, queue, kind="fsdp")


def _tp_worker(rank: int, world: int, port: int, repeats: int, threads: int, queue) -> None:
    """Per-layer, per-pass cost of tensor parallelism beyond its collectives (DTensor dispatch)."""
    _wrapper_overhead_worker(rank, world, port, repeats, threads, queue, kind="tp")


def _wrapper_overhead_worker(rank: int, world: int, port: int, repeats: int, threads: int, queue, *,
                             kind: str) -> None:
    """Models with 1 and 5 blocks, timed with and without the wrapping (`kind`: "fsdp" =
    fully_shard per block and root, "tp" = phalanx's own `apply_tp`, the trainer's code path);
    the slope of the difference over the 4 extra blocks is the cost per block, per pass for tp
    (forward and two backward products: 3 passes). FSDP is timed on a tiny model at 8 tokens;
    tensor parallelism on the overhead model at 8 tokens and at a real micro-batch
    (OVERHEAD_TOKENS[1]) without sequence parallelism, and at the real micro-batch with it."""
    from torch.distributed.device_mesh import init_device_mesh

    from phalanx.model.config import ModelConfig
    from phalanx.model.transformer import Transformer

    torch, dist = init_worker(rank, world, port, threads)
    mesh = init_device_mesh("cpu", (world,))

    def wrap(model, sp: bool) -> None:
        if kind == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            from phalanx.parallel.tensor_parallel import apply_tp

            apply_tp(model, mesh, sp=sp)

    best: dict = {}  # fastest time per (shape, sp, layers, shard) over the rounds

    def per_block(cfg_kw: dict, shape: tuple[int, int], sp: bool = False) -> float:
        """Seconds the wrapping adds per block (slope over 1 -> 5 blocks), fastest repeats."""
        extra = []
        depths = (1, 9) if kind == "tp" else (1, 5)  # tp: a longer lever against the noise of 4 timings
        for layers in depths:
            cfg = ModelConfig(name=kind, n_layers=layers, **cfg_kw)
            tokens = torch.randint(0, cfg.vocab_size, shape)
            times = []
            for shard in (False, True):
                torch.manual_seed(0)
                model = Transformer(cfg)
                if shard:
                    wrap(model, sp)
                samples = []
                for i in range(repeats + 2):
                    dist.barrier()
                    start = time.perf_counter()
                    out = model(tokens)
                    # tp leaves the logits a vocabulary-sharded DTensor (for loss_parallel)
                    (out.to_local() if hasattr(out, "to_local") else out).sum().backward()
                    if i >= 2:
                        samples.append(time.perf_counter() - start)
                key = (shape, sp, layers, shard)
                best[key] = min(best.get(key, math.inf), *samples)
                times.append(best[key])
            extra.append(times[1] - times[0])
        return (extra[1] - extra[0]) / (depths[1] - depths[0])

    if kind == "fsdp":
        tiny = dict(dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
        result = {"overhead_us": max(0.0, per_block(tiny, (1, 8))) * 1e6}
    else:
        passes = 3
        (b, s) = OVERHEAD_TOKENS[1]
        cfg = dict(OVERHEAD_MODEL, max_seq_len=s)
        # Two rounds keeping each timing's best: the sp figure is a difference of two timings
        # taken seconds apart, and one busy spell on a shared machine skewed it 3x.
        for _ in range(2):
            small = per_block(cfg, (1, 8)) / passes
            large = per_block(cfg, (b, s)) / passes
            large_sp = per_block(cfg, (b, s), sp=True) / passes
        result = {"small_us": small * 1e6, "large_us": large * 1e6, "large_sp_us": large_sp * 1e6,
                  "small_elements": 8 * OVERHEAD_MODEL["dim"], "large_elements": b * s * OVERHEAD_MODEL["dim"]}
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def fit_tp_overheads(sample: dict, bus_bw_gbs: float) -> dict:
    """Tensor parallelism's framework costs per layer per pass from `_wrapper_overhead_worker`'s
    tp sample: the growth of the extra time from 8 tokens to a real micro-batch, less what the
    cost model already charges for its 2 all-reduces per forward and backward of tokens x dim bf16
    values at `bus_bw_gbs` on 2 processes (2(n-1)/n = 1 x the bytes; 4 all-reduces over 3
    passes), per element of the activation (`tp_element_overhead_ns`, never negative); the fixed
    part (`tp_layer_overhead_us`) is what is left of the real micro-batch's extra time after
    both; sequence
    parallelism's own fixed cost (`sp_layer_overhead_us`: its DTensor norms, gathers and
    scatters) is the real micro-batch's extra time with it less that without it."""
    def bytes_us(elements: float) -> float:
        return 4 / 3 * 2 * elements * 2 / (bus_bw_gbs * 1e9) * 1e6

    small, large = sample["small_elements"], sample["large_elements"]
    growth = sample["large_us"] - sample["small_us"] - (bytes_us(large) - bytes_us(small))
    element_ns = max(0.0, growth / (large - small) * 1e3)
    fixed_us = max(0.0, sample["large_us"] - element_ns * 1e-3 * large - bytes_us(large))
    sp_us = max(0.0, sample["large_sp_us"] - sample["large_us"])
    return {"tp_layer_overhead_us": fixed_us, "tp_element_overhead_ns": element_ns, "sp_layer_overhead_us": sp_us}


def measure_tp_overhead(*, quick: bool) -> dict:
    """Microseconds tensor parallelism adds per layer per pass on 2 gloo processes: the samples
    `fit_tp_overheads` takes."""
    return _two_process(_tp_worker, quick=quick, what="tensor-parallel")


def _two_process(worker, *, quick: bool, what: str, timeout_s: float = 120.0) -> dict:
    threads = max(1, (os.cpu_count() or 1) // 2)
    return _run_workers(worker, 2, (3 if quick else 10, threads), start_method="fork", timeout_s=timeout_s,
                        what=f"{what} measurement on 2 gloo processes")


def _run_workers(worker, world: int, args: tuple, *, start_method: str, timeout_s: float, what: str,
                 attempts: int = 2) -> dict:
    """Run worker(rank, world, port, *args, queue) on `world` processes; return what rank 0 puts.

    A group that hangs or loses a worker is killed and started again on a fresh port (once by
    default): one 4-process gloo group in some twenty calibrations never reported, and a
    whole calibration should not be lost to that."""
    import queue as queue_module

    import torch.multiprocessing as mp

    from phalanx.testing.fork_ranks import free_port

    ctx = mp.get_context(start_method)
    problem = ""
    for _ in range(attempts):
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        result, deadline = None, time.monotonic() + timeout_s
        while result is None and time.monotonic() < deadline:
            try:
                result = queue.get(timeout=1.0)
            except queue_module.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a worker died: the others would wait for it until the deadline
        crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        if result is not None:
            return result
        problem = f"a worker exited with status {crashed[0]}" if crashed else f"it did not finish in {timeout_s:.0f} s"
    raise UserError(f"{what} failed {attempts} times: {problem}")


def _busy_worker(seconds: float, start, queue) -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    torch.matmul(a, b)
    start.wait()
    count, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        torch.matmul(a, b)
        count += 1
    queue.put(count * 2 * 256**3 / (time.perf_counter() - began))


def measure_delivered_share(cores: int, single_flops: float, *, quick: bool) -> float:
    """Share of `cores` x single-thread throughput this machine delivers to `cores` concurrent
    single-threaded workers, averaged over time rather than at its best moments (the other
    measurements keep their fastest repeat; on a machine shared with other jobs the job gets
    only what those jobs leave)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    queue, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_busy_worker, args=(0.5 if quick else 2.0, start, queue)) for _ in range(cores)]
    for p in procs:
        p.start()
    start.set()
    total = sum(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=10)
    return max(0.05, min(1.0, total / (cores * single_flops)))


def measure_collectives(world: int, backend: str, *, quick: bool, timeout_s: float = 120.0) -> dict[str, float]:
    """Seconds per (op, bytes) on `world` processes, measured by rank 0."""
    sizes = [4096, 1 << 16, 1 << 20] if quick else [4096, 1 << 16, 1 << 20, 1 << 22, 1 << 24]
    repeats = 3 if quick else 10
    threads = max(1, (os.cpu_count() or 1) // world)
    return _run_workers(_collective_worker, world, (backend, sizes, repeats, threads),
                        start_method="fork" if backend == "gloo" else "spawn", timeout_s=timeout_s,
                        what=f"collective measurement on {world} processes ({backend})")


def all_reduce_s(fit: dict[str, float], world: int, nbytes: float) -> float:
    """Seconds of a ring all-reduce of `nbytes` on `world` ranks under `fit_alpha_beta`'s fit."""
    return 2 * (world - 1) * fit["latency_us"] * 1e-6 + 2 * (world - 1) / world * nbytes / (fit["bus_bw_gbs"] * 1e9)


def fit_alpha_beta(samples: dict[str, float], world: int) -> dict[str, float]:
    """Latency (us per ring step) and bus bandwidth (GB/s) of all-reduce on `world` ranks.

    The smallest message gives alpha (t / 2(n-1)); the largest gives beta after removing
    alpha. A joint least-squares fit is dominated by the large messages and lets alpha go
    negative on a noisy shared machine, so the two ends are read separately.
    """
    sizes = sorted(int(k.split(":")[1]) for k in samples if k.startswith("all_reduce:"))
    steps = 2 * (world - 1)
    alpha = samples[f"all_reduce:{sizes[0]}"] / steps
    largest = sizes[-1]
    t = samples[f"all_reduce:{largest}"]
    volume = 2 * (world - 1) / world * largest
    return {"latency_us": alpha * 1e6, "bus_bw_gbs": volume / max(t - steps * alpha, 1e-9) / 1e9}


def calibrate(*, max_procs: int, backend: str, quick: bool, log=print) -> tuple[Cluster, dict]:
    import torch

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    gpu = backend == "nccl"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32  # CPUs train in float32
    report: dict = {"backend": backend, "device": str(device), "dtype": str(dtype)}

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not gpu:
        # One thread, scaled by the core count: a multi-threaded tiny op on a busy machine
        # waits for its slowest (descheduled) thread and measures the neighbours, not the CPU.
        threads_before = torch.get_num_threads()
        torch.set_num_threads(1)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count if gpu else 0
    samples = measure_matmuls(device, dtype, quick=quick)
    peak, half = fit_matmul(samples, sm_count)
    peak *= 1 if gpu else cores
    report["matmul"] = [{"m": m, "n": n, "k": k, "seconds": t, "tflops": 2 * m * n * k / t / 1e12}
                        for m, n, k, t in samples]
    for row in report["matmul"]:
        log(f"matmul {row['m']:>5} x {row['k']:>5} @ {row['k']:>5} x {row['n']:>5}: {row['tflops'] * 1e3:8.2f} GFLOP/s")
    log(f"fit: peak {peak / 1e12 * 1e3:.2f} GFLOP/s, half-efficiency dimension {half:.1f}")
    attention = measure_attention(device, dtype, peak / (1 if gpu else cores), quick=quick)
    bandwidth = measure_bandwidth(device, quick=quick)
    overhead = step_overhead = recompute_overhead = thread_speedup = optimizer_layer = 0.0
    element_efficiency = 1.0
    if not gpu:
        # The real Transformer's training step at one thread (as a rank per core runs) and at
        # all cores' threads (as a lone process runs): fixed costs, element-wise efficiency,
        # and how far the size-dependent work speeds up with threads.
        raw = measure_overheads(device, quick=quick, threads=(1, cores) if cores > 1 else (1,))
        provisional = Cluster(name="fit", devices_per_node=cores, fast_domain=cores, peak_tflops=peak / 1e12,
                              hbm_tbs=bandwidth, hbm_efficiency=1.0, matmul_efficiency=1.0, matmul_half_dim=half,
                              attention_efficiency=max(attention, 1e-3), shared_compute=True)
        fit = fit_overheads(raw, provisional, cores)
        report["overheads"] = {"samples": raw, **fit}
        overhead, step_overhead = fit["layer_overhead_us"], fit["step_overhead_ms"]
        recompute_overhead, element_efficiency = fit["recompute_overhead_us"], fit["elementwise_efficiency"]
        thread_speedup = fit["thread_speedup"]
        optimizer_layer = fit["optimizer_layer_overhead_us"]
        log(f"real layer, one thread: {fit['per_layer_s'][0] * 1e3:.2f} ms at {OVERHEAD_TOKENS[0][0] * OVERHEAD_TOKENS[0][1]} "
            f"tokens, {fit['per_layer_s'][1] * 1e3:.2f} ms at {OVERHEAD_TOKENS[1][0] * OVERHEAD_TOKENS[1][1]} tokens "
            f"(FLOPs explain {fit['flops_s'][1] * 1e3:.2f} ms): element-wise work at {element_efficiency:.2f} of the "
            f"measured bandwidth; {cores} threads run it {thread_speedup:.2f}x as fast as one")
    share = 1.0
    if not gpu:
        square = torch.randn(256, 256)
        single = 2 * 256**3 / _timeit(lambda: torch.matmul(square, square), repeats=20, best=True)
        share = measure_delivered_share(cores, single, quick=quick)
        log(f"{cores} concurrent single-thread workers get {share:.0%} of {cores} x the best single-thread "
            "throughput: every CPU figure is scaled by that share")
        peak, bandwidth = peak * share, bandwidth * share
        overhead, step_overhead, recompute_overhead, optimizer_layer = (
            x / share for x in (overhead, step_overhead, recompute_overhead, optimizer_layer))
        torch.set_num_threads(threads_before)
    log(f"attention at {attention:.2f} of peak; memory bandwidth {bandwidth * 1e3:.1f} GB/s; "
        f"overhead {overhead:.0f} us per layer per pass, {step_overhead:.2f} ms per step, "
        f"{recompute_overhead:.0f} us per recomputed layer, {optimizer_layer:.0f} us per layer per step "
        "(clipping, AdamW, zeroing beyond their bytes)")

    devices = torch.cuda.device_count() if gpu else cores
    fits = {}
    for world in range(2, max(2, max_procs) + 1):
        if gpu and world > devices:
            break
        measured = measure_collectives(world, backend, quick=quick)
        fits[world] = fit_alpha_beta(measured, world)
        report.setdefault("collectives", {})[str(world)] = {"samples": measured, **fits[world]}
        log(f"{backend} {world} processes: latency {fits[world]['latency_us']:.1f} us per step, "
            f"bus bandwidth {fits[world]['bus_bw_gbs']:.2f} GB/s")
    tp_overhead = tp_element = sp_overhead = 0.0
    if not gpu:
        tp_sample = measure_tp_overhead(quick=quick)
        tp_fit = fit_tp_overheads(tp_sample, fits[2]["bus_bw_gbs"] if 2 in fits else 1.0)
        report["tp_overhead"] = {"samples": tp_sample, **tp_fit}
        tp_overhead, tp_element, sp_overhead = (
            tp_fit[k] / share for k in ("tp_layer_overhead_us", "tp_element_overhead_ns", "sp_layer_overhead_us"))
        log(f"tensor parallelism "
            f"{tp_overhead:.0f} us per layer per pass plus {tp_element:.3f} ns per activation element "
            f"({tp_sample['small_us']:.0f} us at 8 tokens, {tp_sample['large_us']:.0f} us at "
            f"{tp_sample['large_elements'] // OVERHEAD_MODEL['dim']}), sequence parallelism "
            f"{sp_overhead:.0f} us more per layer per pass; all beyond their collectives")
    runtime: dict = {}
    fsdp_overhead = 0.0
    if not gpu:
        from phalanx.planner.calibrate_runtime import measure_runtime_overheads

        runtime = measure_runtime_overheads(max_procs=max_procs, collective_fits=fits, quick=quick, log=log)
        report["runtime_overheads"] = runtime
        runtime = dict(  # fixed costs, scaled by the machine's delivered share like the others
            runtime, ddp_step_overhead_ms=tuple((n, ms / share) for n, ms in runtime["ddp_step_overhead_ms"]),
            pp_action_overhead_us=tuple((s, us / share) for s, us in runtime["pp_action_overhead_us"]),
            fsdp_unit_overhead_groups=tuple((n, us / share) for n, us in runtime["fsdp_unit_overhead_groups"]),
            fsdp_pp_overhead_groups=tuple((n, a / share, b / share) for n, a, b in runtime["fsdp_pp_overhead_groups"]),
            fsdp_pp_unit_overhead_us=runtime["fsdp_pp_unit_overhead_us"] / share,
            fsdp_pp_microbatch_overhead_us=runtime["fsdp_pp_microbatch_overhead_us"] / share,
            split_rerun_overhead_us=runtime["split_rerun_overhead_us"] / share,
            tp_microbatch_overhead_us=runtime["tp_microbatch_overhead_us"] / share,
            tp_optimizer_layer_overhead_us=runtime["tp_optimizer_layer_overhead_us"] / share)
        fsdp_overhead = dict(runtime["fsdp_unit_overhead_groups"]).get(2, 0.0)  # the 2-process figure
    bw = statistics.median(f["bus_bw_gbs"] for f in fits.values()) if fits else 1.0
    latency = statistics.median(f["latency_us"] for f in fits.values()) if fits else 50.0

    if gpu:
        props = torch.cuda.get_device_properties(0)
        memory_gib = props.total_memory / 2**30
    else:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cluster = Cluster(
        name="local", devices_per_node=devices, fast_domain=devices, peak_tflops=peak / 1e12,
        memory_gib=round(memory_gib, 2), memory_reserved_gib=round(min(4.0, memory_gib / 4), 2),
        hbm_tbs=bandwidth, hbm_efficiency=1.0, elementwise_efficiency=element_efficiency, intra_bw_gbs=bw, inter_bw_gbs=bw, intra_latency_us=latency, inter_latency_us=latency,
        matmul_efficiency=1.0, matmul_half_dim=half, sm_count=sm_count, attention_efficiency=max(attention, 1e-3),
        layer_overhead_us=overhead, step_overhead_ms=step_overhead, fsdp_unit_overhead_us=fsdp_overhead,
        tp_layer_overhead_us=tp_overhead, tp_element_overhead_ns=tp_element, sp_layer_overhead_us=sp_overhead,
        recompute_overhead_us=recompute_overhead,
        shared_compute=not gpu, comm_sm_fraction=Cluster.comm_sm_fraction if gpu else 0.0,
        thread_speedup=thread_speedup, optimizer_layer_overhead_us=optimizer_layer,
        measured_groups=tuple((w, f["latency_us"], f["bus_bw_gbs"]) for w, f in sorted(fits.items())),
        **runtime,
    )
    return cluster, report


def calibrate_command(args) -> int:
    out = Path(args.out) if args.out else local_cluster_path()
    cluster, report = calibrate(max_procs=args.max_procs, backend=args.backend, quick=args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dataclasses.asdict(cluster), indent=2) + "\n")
    side = out.with_suffix(".measurements.json")
    side.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} (cluster file) and {side} (raw measurements)")
    return 0
