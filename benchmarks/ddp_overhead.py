"""phalanx `dp=2` against a plain hand-written PyTorch DDP loop: step-time ratio.

Both arms train the same model (the `small` preset unless --model says otherwise) on the
same global batch and sequence length, on 2 gloo ranks forked from this process, with the
same AdamW, clipping and loss all-reduce per step. The plain loop is what a user would write
by hand: DDP wrap, random windows of the corpus, forward, backward, clip, step, starting
from the same initial weights. Arms alternate in ABBA order (A B, B A, A B, ...) so machine
noise and any drift hit both alike. Each round (one run of each arm, back to back) gives one
ratio of median step times; the result is the median of the rounds' ratios, with their spread
(lowest and highest), beside the ratios of the pooled median and fastest steps (the first
steps of each run are warm-up and skipped).

Reproduce:  .venv/bin/python benchmarks/ddp_overhead.py            (target: median ratio <= 1.02
            over at least 5 rounds, on a quiet machine)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.testing.fork_ranks import run_ranks

WARMUP = 3


def phalanx_arm(model: str, steps: int, batch: int, seq: int, out: str) -> list[float]:
    from phalanx.train.config import TrainConfig
    from phalanx.train.loop import train
    from phalanx.train.metrics import read_metrics

    cfg = TrainConfig(model=model, plan="dp=2", steps=steps, global_batch=batch, seq_len=seq, eval_every=0,
                      ckpt_every=0, sample_tokens=0, progress=False, device="cpu", out=out)
    train(cfg, Path(out))
    if dist.get_rank() == 0:
        return [r["step_time_s"] for r in read_metrics(Path(out) / "metrics.jsonl")][WARMUP:]
    return []


def plain_arm(model: str, steps: int, batch: int, seq: int, out: str) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    from phalanx.data.corpus import stdlib_corpus
    from phalanx.model.by_name import model_config
    from phalanx.model.init import build_model, init_weights

    cfg = model_config(model)
    net = DistributedDataParallel(init_weights(build_model(cfg), cfg, 0, "cpu"))  # phalanx's initial weights
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.from_numpy(stdlib_corpus().train.astype("int64"))
    per_rank = batch // dist.get_world_size()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        starts = torch.randint(0, len(data) - seq - 1, (per_rank,))
        rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])  # (per_rank, seq + 1)
        logits = net(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        logged.item()
        times.append(time.perf_counter() - began)
    return times[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6, help="ABBA rounds, one run of each arm per round (>= 5)")
    args = parser.parse_args()
    shape = (args.model, args.steps, args.global_batch, args.seq_len)
    times = {"phalanx": [], "plain": []}
    ratios = []  # one per round: median phalanx step / median plain step of that round's two runs
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            this_round = {}
            for arm in ("phalanx", "plain") if round_ % 2 == 0 else ("plain", "phalanx"):
                fn = phalanx_arm if arm == "phalanx" else plain_arm
                this_round[arm] = run_ranks(2, fn, *shape, f"{tmp}/run{round_}", timeout_s=900)[0]
                times[arm] += this_round[arm]
            ratios.append(statistics.median(this_round["phalanx"]) / statistics.median(this_round["plain"]))
            print(f"round {round_ + 1}/{args.rounds}: ratio {ratios[-1]:.3f}", flush=True)
    medians = {arm: statistics.median(values) for arm, values in times.items()}
    fastest = {arm: min(values) for arm, values in times.items()}
    print(f"model {args.model}, dp=2 on 2 gloo ranks, global batch {args.global_batch} x {args.seq_len} tokens, "
          f"{len(times['plain'])} measured steps per arm")
    for arm in times:
        print(f"  {arm:8s} median step {medians[arm] * 1000:8.1f} ms   fastest step {fastest[arm] * 1000:8.1f} ms")
    # The fastest step is the least disturbed by other work on a shared machine; the median
    # is the typical step. The target applies to the median of the rounds' ratios.
    print(f"pooled steps: ratio phalanx / plain = {medians['phalanx'] / medians['plain']:.3f} (median), "
          f"{fastest['phalanx'] / fastest['plain']:.3f} (fastest)")
    print(f"ratio phalanx / plain = {statistics.median(ratios):.3f} (median of {len(ratios)} ABBA rounds; "
          f"spread {min(ratios):.3f} to {max(ratios):.3f})  (target <= 1.02)")


if __name__ == "__main__":
    main()
