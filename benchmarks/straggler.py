"""A slow rank under data parallelism: shares adapted to measured speeds against equal shares;
with `--plan pp=2,...`, a slow pipeline stage: layers re-split from measured stage times
against the planned split.

dp=2 (or the `--plan` given) on 2 gloo ranks forked from this process, each pinned to its own core
(`os.sched_setaffinity` on every thread of the rank: gloo's threads too), the `small` model.
Arms, in one run:
  busy:  a busy-looping process pinned to rank 1's core (rank 1 at about half speed), with
         adaptation (the default) and with `--no-adapt` (equal shares: the baseline);
  quiet: no competitor, with `--no-adapt` and with adaptation (what adapting costs).
Tokens/s: the global batch's tokens over the median step time of steps WARMUP+1 .. steps
(after the adaptation's first decision window), so both arms of a pair are measured over the
same steps. Also printed: the adapt and straggler events, and the step-to-step noise of each
rank's compute time in the quiet equal-shares arm (median absolute deviation / median), which
the adaptation's hysteresis band and straggler margin are set above (phalanx/adapt_policy.py).

Reproduce:  .venv/bin/python benchmarks/straggler.py     (goals: busy adapt / no-adapt >= 1.3x;
            quiet adapt / no-adapt >= 0.98; about 3 minutes on 2 cores)
            .venv/bin/python benchmarks/straggler.py --plan pp=2,microbatches=4   (the pipeline:
            a re-split's own seconds are in its `resplit` event row, not in the median step)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

from phalanx.testing.fork_ranks import run_ranks

WARMUP = 14
"""Steps left out of the median: the first steps' warm-up and the adaptation's first window (8)."""


def _pin_process(cores: set[int]) -> None:
    """Every thread of this process on `cores` (sched_setaffinity(0) would move only the
    calling thread; the process group's threads were started before)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:  # a thread that ended meanwhile
            pass


def _busy(core: int) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        pass


def _rank(cfg, cores: list[int]) -> None:
    import torch.distributed as dist

    from phalanx.train.loop import train

    _pin_process({cores[dist.get_rank() % len(cores)]})
    train(cfg, Path(cfg.out))


def _arm(cfg, cores: list[int], name: str, *, adapt: bool, busy: bool) -> dict:
    competitor = None
    if busy:
        competitor = multiprocessing.get_context("fork").Process(target=_busy, args=(cores[1 % len(cores)],), daemon=True)
        competitor.start()
    try:
        out = str(Path(cfg.out) / name)
        run_ranks(2, _rank, cfg.replace(adapt=adapt, out=out), cores, timeout_s=900)
    finally:
        if competitor is not None:
            competitor.terminate()
            competitor.join()
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row and row["step"] > WARMUP]
    step_s = statistics.median(row["step_time_s"] for row in steps)
    return {"name": name, "tokens_per_s": cfg.global_batch * cfg.seq_len / step_s, "step_s": step_s,
            "events": [row for row in rows if "event" in row], "steps": steps}


def _noise(steps: list[dict]) -> list[float]:
    """Per rank: median absolute deviation of compute_s over its median."""
    out = []
    for rank in range(len(steps[0]["compute_s_by_rank"])):
        values = [row["compute_s_by_rank"][rank] for row in steps]
        middle = statistics.median(values)
        out.append(statistics.median(abs(v - middle) for v in values) / middle)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", default="small")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--plan", default="dp=2", help="a layout of 2 processes: dp=2 (shares) or pp=2,... (the split)")
    args = parser.parse_args()

    from phalanx.train.config import TrainConfig

    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise SystemExit("needs 2 cores")
    out = tempfile.mkdtemp(prefix="straggler-")
    cfg = TrainConfig(model=args.model, plan=args.plan, steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len,
                      eval_every=0, ckpt_every=0, sample_tokens=0, progress=False, plot=False, device="cpu", out=out,
                      threads=1)
    print(f"model {args.model}, {args.plan} on cores {cores}, global batch {args.global_batch} x {args.seq_len} tokens, "
          f"{args.steps} steps (median step of steps {WARMUP + 1}..{args.steps}), load before: {os.getloadavg()[0]:.1f}")
    began = time.perf_counter()
    arms = [
        _arm(cfg, cores, "busy-adapt", adapt=True, busy=True),
        _arm(cfg, cores, "busy-no-adapt", adapt=False, busy=True),
        _arm(cfg, cores, "quiet-no-adapt", adapt=False, busy=False),
        _arm(cfg, cores, "quiet-adapt", adapt=True, busy=False),
    ]
    for arm in arms:
        print(f"  {arm['name']:15s} {arm['tokens_per_s']:8.0f} tokens/s   median step {arm['step_s'] * 1000:7.1f} ms")
        for event in arm["events"]:
            print(f"    {json.dumps(event)}")
    by = {arm["name"]: arm for arm in arms}
    noise = _noise(by["quiet-no-adapt"]["steps"])
    print(f"compute-time noise, quiet equal shares (MAD / median per rank): {', '.join(f'{n:.1%}' for n in noise)}")
    busy = by["busy-adapt"]["tokens_per_s"] / by["busy-no-adapt"]["tokens_per_s"]
    quiet = by["quiet-adapt"]["tokens_per_s"] / by["quiet-no-adapt"]["tokens_per_s"]
    print(f"busy rank 1:  adapt / --no-adapt = {busy:.2f}x (goal >= 1.3x, ideal 1.5x for a half-speed rank)")
    print(f"no competitor: adapt / --no-adapt = {quiet:.3f} (goal >= 0.98: adapting costs < 2%)")
    print(f"({time.perf_counter() - began:.0f} s, load after: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
