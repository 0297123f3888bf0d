"""Predicted vs measured step time on this machine, for a small model at 1, 2 and 4 processes.

    PYTHONPATH=. python benchmarks/planner_local.py [--calibrate] [--model tiny] [--steps 8]

1. Reads the calibrated cluster (`phalanx calibrate`, or --calibrate to run it first).
2. At each process count, ranks every layout with the planner and picks a spread of them:
   the planner's first choice, then layouts evenly down its ranking (at least ten in all).
3. Runs each with the trainer, `python -m phalanx train --model M --nproc N --plan P
   --steps K --global-batch B --seq-len S --out DIR`, and takes the median `step_time_s` of
   DIR/metrics.jsonl after the first `--warmup` steps.
4. Prints predicted vs measured (each run's median step, and its fastest step: calibration
   measures best-case throughput, and a shared machine only ever slows runs down) and the
   error per layout, the median |error| (target 15%),
   and per process count whether the planner's first choice measured within 10% of the
   fastest measured layout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from phalanx.planner.options import trainer_options
from phalanx.planner.hardware import cluster_from_name, local_cluster_path
from phalanx.planner.layout import Workload
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.search import parse_fix, search


def pick(ranked, count: int):
    """The first choice, then evenly spaced further down the ranking."""
    if len(ranked) <= count or count == 1:
        return list(ranked[:count])
    step = (len(ranked) - 1) / (count - 1)
    return [ranked[round(i * step)] for i in range(count)]


def run_trainer(args, nproc: int, plan: str, out: Path) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "phalanx", "train", "--model", args.model, "--nproc", str(nproc), "--plan", plan,
           "--steps", str(args.steps), "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
           "--out", str(out), "--no-progress", "--eval-every", "0", "--sample-tokens", "0",
           # A run that hangs fails within a third of the timeout, naming the collective it was in.
           "--collective-timeout", str(max(10.0, args.timeout / 3))]
    # The trainer's own thread count (all cores for one process), not this script's OMP_NUM_THREADS=1.
    env = {k: v for k, v in os.environ.items() if not (k == "OMP_NUM_THREADS" and _OMP_SET_HERE)}
    proc = _run_in_own_group(cmd, env, args.timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"`{' '.join(cmd)}` exited {proc.returncode}: {' | '.join(tail)}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][args.warmup:]
    if not times:
        raise RuntimeError(f"{out / 'metrics.jsonl'} has no step_time_s after {args.warmup} warm-up steps")
    return statistics.median(times), min(times)


def _run_in_own_group(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run`, but a timeout kills the trainer's workers too: they share the launcher's
    process group, and a hung run's four workers outlived its killed launcher for good."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--per-size", default="3,4,5", help="layouts to run at each process count")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per training run")
    parser.add_argument("--calibrate", action="store_true", help="run `phalanx calibrate` first")
    parser.add_argument("--fix", default="", help="restrict the layouts (--fix grammar), e.g. tp=1,pp=1 for a "
                        "trainer that runs data parallelism only")
    parser.add_argument("--record", action="store_true",
                        help="write the median |error| into phalanx/planner/validation.json (the plan table's "
                             "error band for calibrated and described clusters)")
    args = parser.parse_args()

    if args.calibrate or not local_cluster_path().exists():
        print("calibrating this machine (phalanx calibrate) ...", flush=True)
        subprocess.run([sys.executable, "-m", "phalanx", "calibrate", "--max-procs",
                        str(max(int(p) for p in args.procs.split(",")))], check=True)
    cluster = cluster_from_name("local")
    model = model_from_name(args.model)
    work = Workload(global_batch=args.global_batch, seq_len=args.seq_len)
    print(f"cluster: {local_cluster_path()} ({cluster.peak_tflops * 1e3:.1f} GFLOP/s node peak)")
    print(f"{'procs':>5}  {'layout':58} {'predicted':>9} {'median':>9} {'error':>7} {'fastest':>9} {'error':>7}")
    errors, errors_min = [], []
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="planner-local-") as tmp:
        for nproc, count in zip((int(p) for p in args.procs.split(",")), (int(c) for c in args.per_size.split(","))):
            # What `phalanx plan --cluster local` predicts for the trainer's default fp32 runs.
            ranked = search(model, cluster, work, world_size=nproc, fixed=parse_fix(args.fix),
                            options=trainer_options("fp32", cluster), keep=10_000).ranked
            measured = []
            for rank, est in enumerate(pick(ranked, count)):
                plan = est.layout.plan.to_string()
                try:
                    t, t_min = run_trainer(args, nproc, plan, Path(tmp) / f"n{nproc}-{rank}")
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(f"{nproc:>5}  {plan:58} failed: {exc}")
                    continue
                err = (est.step_time_s - t) / t
                err_min = (est.step_time_s - t_min) / t_min
                errors.append(abs(err))
                errors_min.append(abs(err_min))
                measured.append((t, est))
                print(f"{nproc:>5}  {plan:58} {est.step_time_s:9.4f} {t:9.4f} {err:+7.1%} {t_min:9.4f} "
                      f"{err_min:+7.1%}", flush=True)
            if measured and ranked:
                first = next((t for t, e in measured if e is ranked[0]), None)
                fastest = min(t for t, _ in measured)
                if first is not None:
                    verdicts.append((nproc, first / fastest - 1))
    if not errors:
        print("no run succeeded: is `phalanx train` (the trainer) available?")
        return 2
    print(f"median |error| over {len(errors)} layouts: {statistics.median(errors):.1%} against each run's median "
          f"step (target 15%); {statistics.median(errors_min):.1%} against its fastest step")
    if args.record:
        from phalanx.planner.validation import record

        record("local", statistics.median(errors), len(errors),
               source=f"benchmarks/planner_local.py --record: median |error| of predicted against measured step time "
                      f"on this machine ({len(errors)} layouts at {args.procs} processes, model {args.model})")
        print("written into phalanx/planner/validation.json as the local step-time band")
    for nproc, gap in verdicts:
        print(f"{nproc} processes: planner's first choice measured {gap:.1%} slower than the fastest measured "
              f"({'within' if gap <= 0.10 else 'outside'} the 10% target)")
    return 0


_OMP_SET_HERE = False

if __name__ == "__main__":
    _OMP_SET_HERE = "OMP_NUM_THREADS" not in os.environ
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
