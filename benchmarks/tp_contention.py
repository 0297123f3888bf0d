"""How much tensor parallelism's framework cost grows with more processes than cores.

The planner doubles every fixed cost measured on 2 processes when 4 share 2 cores (its
queueing factor). This times what phalanx's `apply_tp` (with sp, the trainer's loss) adds per
block over 1 -> 9 blocks with 2 processes (one tp=2 group) and with 4 (two tp=2 groups at
once), and prints the ratio against that factor; also the bare model's time per block, fastest
and median, to show what the fastest repeat hides under oversubscription.

    PYTHONPATH=. python benchmarks/tp_contention.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from phalanx.testing.fork_ranks import run_ranks


def _per_block(world: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from phalanx.model.config import ModelConfig
    from phalanx.model.transformer import Transformer
    from phalanx.parallel.tensor_parallel import apply_tp, loss_context
    from phalanx.plan import Plan
    from phalanx.calibrate.compute import OVERHEAD_MODEL, OVERHEAD_TOKENS
    from phalanx.train.loss import token_loss

    tp_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    (b, s) = OVERHEAD_TOKENS[1]
    times = {}
    for layers in (1, 9):
        cfg = ModelConfig(name="tp-contention", n_layers=layers, max_seq_len=s, **OVERHEAD_MODEL)
        tokens = torch.randint(0, cfg.vocab_size, (b, s))
        for tp in (False, True):
            torch.manual_seed(0)
            model = Transformer(cfg)
            if tp:
                apply_tp(model, tp_mesh, sp=True)
            plan = Plan(tp=2, sp=True) if tp else Plan()
            samples = []
            for i in range(repeats + 2):
                dist.barrier()
                start = time.perf_counter()
                with loss_context(plan):
                    token_loss(model(tokens), tokens).backward()
                if i >= 2:
                    samples.append(time.perf_counter() - start)
            times[(layers, tp)] = (min(samples), statistics.median(samples))
    out = {}
    for k, stat in enumerate(("fastest", "median")):
        bare = (times[(9, False)][k] - times[(1, False)][k]) / 8
        extra = ((times[(9, True)][k] - times[(9, False)][k]) - (times[(1, True)][k] - times[(1, False)][k])) / 8
        out[stat] = {"bare_ms": bare * 1e3, "tp_extra_ms": extra * 1e3}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    two, four = (run_ranks(w, _per_block, w, args.repeats, timeout_s=600)[0] for w in (2, 4))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    assumed = max(1.0, 4 / cores) / max(1.0, 2 / cores)  # the planner's queueing factor, 4 vs 2 processes
    for stat in ("fastest", "median"):
        a, b = two[stat], four[stat]
        print(f"{stat:8} bare model {a['bare_ms']:.2f} -> {b['bare_ms']:.2f} ms per block; apply_tp adds "
              f"{a['tp_extra_ms']:.2f} ms per block at 2 processes, {b['tp_extra_ms']:.2f} at 4: "
              f"ratio {b['tp_extra_ms'] / a['tp_extra_ms']:.2f} (the planner assumes {assumed:.2f} on {cores} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
