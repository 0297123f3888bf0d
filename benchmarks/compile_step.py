"""`--compile` against eager: training step time of one process, and the time to compile.

One model is built as `phalanx train --compile` builds it (`parallelize(..., compile=True)`:
torch.compile per block, inductor; on CPU its C++ backend, built with gcc). Its steps
(forward, backward, clipping, AdamW) then alternate between compiled and eager in ABBA order
(A B, B A, ...), eager ones under `torch.compiler.set_stance("force_eager")`, which runs the
same modules' Python code: same model, same batch, same process, so machine noise and drift
hit both arms alike. Ratios are of median and of fastest step times.

Compile time: the first compiled step's time less the first eager step's, with inductor's
on-disk cache in a fresh temporary directory (a cold compile, what a first run on a new
machine pays); `--warm-cache` keeps the user's cache (what later runs pay).

Reproduce:  .venv/bin/python benchmarks/compile_step.py
            .venv/bin/python benchmarks/compile_step.py --model tiny --steps 6   # seconds, CI-sized
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time

import torch


def step_fn(model, optimizer, inputs, targets):
    from phalanx.parallel.grad_norm import clip_grad_norm
    from phalanx.train.loss import token_loss

    def step() -> float:
        began = time.perf_counter()
        loss = token_loss(model(inputs), targets)
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - began

    return step


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (gcc runs; a worker pool that
    inductor keeps alive is not counted: its share shows in the wall time only)."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per arm")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache (default: a fresh one)")
    args = parser.parse_args()
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="phalanx-inductor-")
    torch.set_num_threads(args.threads)

    from phalanx.model.by_name import model_config
    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.mesh import build_mesh
    from phalanx.plan import Plan
    from phalanx.train.config import TrainConfig
    from phalanx.train.loop import make_optimizer

    cfg = model_config(args.model)
    model = parallelize(cfg, build_mesh(Plan(), torch.device("cpu")), seed=0, compile=True)
    optimizer = make_optimizer(model, TrainConfig(lr=1e-4))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=generator)
    step = step_fn(model, optimizer, tokens[:, :-1], tokens[:, 1:])  # (batch, seq) each

    def eager() -> float:
        with torch.compiler.set_stance("force_eager"):
            return step()

    first_eager = eager()
    cpu_before = _cpu_seconds()
    first_compiled = step()  # compiles the block's forward and backward
    compile_cpu = _cpu_seconds() - cpu_before
    compile_s = first_compiled - first_eager
    times: dict[str, list[float]] = {"compiled": [], "eager": []}
    for i in range(args.steps):
        order = (step, eager) if i % 2 == 0 else (eager, step)
        for arm in order:
            times["compiled" if arm is step else "eager"].append(arm())
    median = {arm: statistics.median(t) for arm, t in times.items()}
    fastest = {arm: min(t) for arm, t in times.items()}

    print(f"model {args.model}, batch {args.batch} x {args.seq_len} tokens, fp32, {args.threads} thread(s), "
          f"torch {torch.__version__}, inductor on {'a warm' if args.warm_cache else 'a cold'} cache, {args.steps} steps per arm (ABBA)")
    print(f"compile time: {compile_s:.1f} s wall, {compile_cpu:.1f} s CPU (this process and gcc) "
          f"(first compiled step {first_compiled:.1f} s, first eager step {first_eager:.2f} s)")
    for arm in ("eager", "compiled"):
        print(f"  {arm:9s} median step {median[arm] * 1e3:8.1f} ms   fastest step {fastest[arm] * 1e3:8.1f} ms")
    print(f"ratio compiled / eager step time = {median['compiled'] / median['eager']:.3f} (median), "
          f"{fastest['compiled'] / fastest['eager']:.3f} (fastest); speed-up {median['eager'] / median['compiled']:.2f}x "
          "(torchtitan, Llama 3 8B on 8 H100s: 1.16x)")


if __name__ == "__main__":
    main()
