"""What FSDP and tensor parallelism (phalanx's own apply_tp) add per block on 2 gloo
processes, beyond their collectives' bytes."""

from __future__ import annotations

import math
import time

from phalanx.calibrate.compute import OVERHEAD_MODEL, OVERHEAD_TOKENS
from phalanx.calibrate.workers import init_worker, smoke, two_process
from phalanx.model.config import ModelConfig


def fsdp_worker(rank: int, world: int, port: int, repeats: int, threads: int, queue) -> None:
    """Per-unit, per-micro-batch cost of FSDP2 beyond its collectives' bytes."""
    wrapper_overhead_worker(rank, world, port, repeats, threads, queue, kind="fsdp")


def tp_worker(rank: int, world: int, port: int, repeats: int, threads: int, queue) -> None:
    """Per-layer, per-pass cost of tensor parallelism beyond its collectives (DTensor dispatch)."""
    wrapper_overhead_worker(rank, world, port, repeats, threads, queue, kind="tp")


def wrapper_overhead_worker(rank: int, world: int, port: int, repeats: int, threads: int, queue, *,
                             kind: str) -> None:
    """Models with 1 and 5 blocks, timed with and without the wrapping (`kind`: "fsdp" =
    fully_shard per block and root, "tp" = phalanx's own `apply_tp`, the trainer's code path);
    the slope of the difference over the 4 extra blocks is the cost per block, per pass for tp
    (forward and two backward products: 3 passes). FSDP is timed on a tiny model at 8 tokens;
    tensor parallelism on the overhead model at 8 tokens and at a real micro-batch
    (OVERHEAD_TOKENS[1]) without sequence parallelism, and at the real micro-batch with it."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from torch.distributed.device_mesh import init_device_mesh

    from phalanx.model.transformer import Transformer

    torch, dist = init_worker(rank, world, port, threads)
    mesh = init_device_mesh("cpu", (world,))

    def wrap(model, sp: bool) -> None:
        if kind == "fsdp":
            # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
            from torch.distributed.fsdp import fully_shard

            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
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
        for _ in range(1 if smoke() else 2):
            small = per_block(cfg, (1, 8)) / passes
            large = per_block(cfg, (b, s)) / passes
            large_sp = per_block(cfg, (b, s), sp=True) / passes
        result = {"small_us": small * 1e6, "large_us": large * 1e6, "large_sp_us": large_sp * 1e6,
                  "small_elements": 8 * OVERHEAD_MODEL["dim"], "large_elements": b * s * OVERHEAD_MODEL["dim"]}
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def measure_tp_overhead(*, quick: bool) -> dict:
    """Microseconds tensor parallelism adds per layer per pass on 2 gloo processes: the samples
    `fit_tp_overheads` takes."""
    return two_process(tp_worker, quick=quick, what="tensor-parallel")
