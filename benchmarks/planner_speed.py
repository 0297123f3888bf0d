"""Wall time of a whole `phalanx plan` command for the 1T-parameter GPT on 3,072 GPUs.

The issue's target: a full search for a GPT of 128 layers, hidden 25,600, 160 heads,
sequence 2,048, vocabulary 51,200 on 3,072 `dgx-a100` GPUs at global batch 3,072, whole
command (interpreter start, imports, search, printing) <= 1 s on this machine. Each repeat
runs the command in a fresh interpreter; a bare `python -c pass` is timed beside it in the
same run (the machine is shared, so the fixed cost of starting Python moves with the load).

    PYTHONPATH=. python benchmarks/planner_speed.py [--repeats 5] [--zero-levels 0,1,2,3] [--against DIR]
    PYTHONPATH=. python benchmarks/planner_speed.py --layers 1000000000000

--layers N times instead `phalanx plan` for a model of N small layers (DEEP, dense and MoE
ones, 64 H100s) against the same model with 12 layers, alternating, and prints the ratio: the
planner's time should not grow with the declared depth (issue 25).

--against DIR times the same command from another source tree (say `git archive <commit> |
tar -x -C DIR`), alternating with this one's runs, and prints the ratio of the two: a
before/after figure whose two sides saw the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = {"name": "gpt-1t", "n_layers": 128, "dim": 25600, "n_heads": 160, "n_kv_heads": 160, "ffn_dim": 102400,
         "mlp": "gelu", "vocab_size": 51200, "max_seq_len": 2048}
TARGET_S = 1.0
DEEP = {"name": "deep", "dim": 8, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 4, "vocab_size": 256, "n_experts": 2,
        "experts_per_token": 2, "n_dense_layers": 3, "moe_every": 2}
"""Layers small enough that 10^12 of them stay under ModelConfig's parameter bound."""


def timed(argv: list[str], pythonpath: str | None = None) -> tuple[float, str]:
    # `python -m` puts the working directory first on sys.path: run the other tree from inside it.
    env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else None
    start = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=pythonpath)
    elapsed = time.perf_counter() - start
    if run.returncode != 0:
        sys.exit(f"command failed ({run.returncode}): {' '.join(argv)}\n{run.stderr}")
    return elapsed, run.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--zero-levels", default="0,1,2,3", help="the search space's ZeRO levels (default: all)")
    parser.add_argument("--against", default="", help="another source tree to time the same command from")
    parser.add_argument("--layers", type=int, default=0, help="time a DEEP model of this many layers against 12")
    args = parser.parse_args()
    if args.layers:
        return depth(args.layers, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "gpt-1t.json"
        model.write_text(json.dumps(MODEL))
        plan = [sys.executable, "-m", "phalanx", "plan", "--model", str(model), "--cluster", "dgx-a100",
                "--gpus", "3072", "--global-batch", "3072", "--seq-len", "2048", "--zero-levels", args.zero_levels]
        bare = [sys.executable, "-c", "pass"]
        timed(plan)  # warm the file cache and the bytecode
        if args.against:
            timed(plan, args.against)
        plans, bares, others, out = [], [], [], ""
        for _ in range(args.repeats):
            t, out = timed(plan)
            plans.append(t)
            bares.append(timed(bare)[0])
            if args.against:
                others.append(timed(plan, args.against)[0])
    summary = out.strip().splitlines()[-1]
    best, median = min(plans), statistics.median(plans)
    print(summary)
    print(f"whole `phalanx plan` command: fastest {best:.2f} s, median {median:.2f} s over {args.repeats} runs "
          f"(bare interpreter start {min(bares):.2f} s in the same runs)")
    print(f"against the {TARGET_S:.0f} s target: fastest {best / TARGET_S:.2f}x, median {median / TARGET_S:.2f}x "
          f"({'within' if best <= TARGET_S else 'over'} the target at the fastest run)")
    if others:
        print(f"the same command from {args.against}: fastest {min(others):.2f} s, median "
              f"{statistics.median(others):.2f} s; this tree takes {best / min(others):.2f}x of it at the fastest, "
              f"{median / statistics.median(others):.2f}x at the median")


def depth(layers: int, repeats: int) -> None:
    """`phalanx plan` on DEEP with `layers` layers against 12, alternating in one run."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = {}
        for n in (12, layers):
            path = Path(tmp) / f"deep-{n}.json"
            path.write_text(json.dumps({**DEEP, "n_layers": n}))
            argv[n] = [sys.executable, "-m", "phalanx", "plan", "--model", str(path), "--cluster", "dgx-h100",
                       "--gpus", "64", "--global-batch", "64", "--seq-len", "1024", "--top", "1"]
        times: dict[int, list[float]] = {12: [], layers: []}
        for n in argv:
            subprocess.run(argv[n], capture_output=True)  # warm the file cache and the bytecode
        for _ in range(repeats):
            for n in argv:
                start = time.perf_counter()
                run = subprocess.run(argv[n], capture_output=True, text=True)
                times[n].append(time.perf_counter() - start)
                if run.returncode > 1:  # 1: planned, nothing fits (the deep model's weights do not)
                    sys.exit(f"command failed ({run.returncode}): {' '.join(argv[n])}\n{run.stderr}")
    deep, shallow = statistics.median(times[layers]), statistics.median(times[12])
    print(f"whole `phalanx plan` command, median of {repeats}: {layers:,} layers {deep:.2f} s, 12 layers "
          f"{shallow:.2f} s; ratio {deep / shallow:.2f}")


if __name__ == "__main__":
    main()
