"""Context parallelism: per-rank activation memory of cp = 1, 2, 4 and step time of cp = 1, 2,
each cp > 1 with its all-gather and with its ring (`cp_ring=true`).

    PYTHONPATH=. python benchmarks/context_parallel.py            # about 2 minutes on 2 cores
    PYTHONPATH=. python benchmarks/context_parallel.py --steps 12 # a longer step-time median
    PYTHONPATH=. python benchmarks/context_parallel.py --step-cp 1,2,4  # cp=4's step too (4 processes)

Model `small` (dim 192, 6 layers, 6 query heads and 2 KV heads), fp32, global batch 2 x 1024
tokens in every row, so tokens per step are fixed and each cp rank holds 1024 / cp positions
of each sequence.

Memory: cp forked gloo ranks build the model as `phalanx train` does (`parallelize`) and run
one training forward and the loss of their chunks under PyTorch's `MemTracker`; a row's figure
is rank 0's "Activation" bytes after the forward minus before it (what the backward will read;
every rank holds the same amount). Expect less than 1/cp: each rank also keeps the gathered
keys and values of the whole sequence for its attention backward (docs/layout.md).

Step time: `phalanx train` (the trainer's own loop, `train()`) on cp processes, median
`step_time_s` of the steps after the first. On the 2-core development machine cp=2 puts one
rank per core; the ratio says how much of the ideal 0.5 the gathers and the halved matrix
sizes leave, not what a GPU would show. Before and after a change of the cp implementation
(issue 38: the explicit mask replaced by causal key blocks, the gather overlapped, the ring
added): run this at both commits on the same quiet machine; the gather and ring rows of one
run compare the two schedules on the same machine state (`--no-ring`: the gather only).

Attention alone (`--attention-rounds`): one layer's attention forward and backward on cp = 2
and 4 gloo ranks, one thread each, the explicit mask of before issue 38 (rebuilt here as that
implementation ran it: gathered keys, a (queries x keys) causal mask, one
scaled_dot_product_attention) against the trainer's key blocks with the gather and with the
ring, alternated call by call, wall and process CPU seconds, ratios from the same run.

Each row prints its ratio against cp=1 measured in the same run, and beside it the planner's
prediction for the same layout (`phalanx plan --fix cp=N,... --json`, the `activations` of its
memory breakdown and its `step_time_s`, cluster `local`), or "planner: no cp yet" where the
planner's rows carry no `cp`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL, SEQ, BATCH = "small", 1024, 2


def measure_activations(plan_text: str) -> int:
    """On one rank of a started group: activation bytes held after the training forward."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    from phalanx.data.batches import chunk_positions
    from phalanx.model.by_name import model_config
    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.mesh import build_mesh
    from phalanx.plan import plan_from_string
    from phalanx.train.loss import token_loss

    cfg = model_config(MODEL)
    mesh = build_mesh(plan_from_string(plan_text, dist.get_world_size()), torch.device("cpu"))
    model = parallelize(cfg, mesh, seed=0, seq_len=SEQ)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    mine = chunk_positions(SEQ, mesh.cp, mesh.cp_rank)
    inputs, targets = tokens[:, :-1][:, mine], tokens[:, 1:][:, mine]  # (batch, seq / cp)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        token_loss(model(inputs), targets).backward()
    snapshots = tracker.memory_tracking[model].snapshots
    device = torch.device("cpu")
    held = [snapshots[state][0][device].get("Activation", 0) for state in (_ModState.POST_FW, _ModState.PRE_FW)]
    return held[0] - held[1]


def step_times(plan: str, steps: int, out: str) -> list[float]:
    """On every rank: train `steps` steps of `plan`; rank 0's step_time_s of each."""
    import torch.distributed as dist

    from phalanx.testing.small_corpus import ONE_FILE_CORPUS
    from phalanx.train.config import TrainConfig
    from phalanx.train.loop import train

    cfg = TrainConfig(model=MODEL, data=ONE_FILE_CORPUS, steps=steps, global_batch=BATCH, seq_len=SEQ, warmup_steps=1,
                      eval_every=0, ckpt_every=0, sample_tokens=0, progress=False, device="cpu", plan=plan,
                      out=f"{out}/{plan.replace(',', '_').replace('=', '-')}", sync_checkpoint=True)
    train(cfg, Path(cfg.out))
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    return [row["step_time_s"] for row in rows if "step_time_s" in row]


def attention_seconds(rounds: int) -> dict[str, list[tuple[float, float]]]:
    """On every rank of a cp group (the whole world): one attention layer of `small`'s shape
    (batch 2 x 1024 tokens, 6 query heads and 2 KV heads of 32 channels), forward and backward,
    three ways alternated call by call: "mask", the implementation before issue 38 (keys and
    values gathered by torch's functional all-gather, a (queries x keys) causal mask of this
    rank's positions, scaled_dot_product_attention over all of them), and the trainer's
    `ChunkAttention` with the gather and with the ring. -> {way: [(wall s, process CPU s)]}, per
    call; CPU seconds (every thread of the rank, gloo's included) move less with the machine's
    load than wall seconds do."""
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from phalanx.data.batches import chunk_positions
    from phalanx.parallel.context_parallel_attention import ChunkAttention
    from phalanx.parallel.context_parallel_layout import rank_chunks
    from phalanx.parallel.context_parallel_schedule import gather_keys_values

    torch.set_num_threads(1)  # one core per rank, as on the 2-core machine with cp=2
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    gen = torch.Generator().manual_seed(rank)
    local = SEQ // cp
    q = torch.randn(BATCH, 6, local, 32, generator=gen)
    k, v = (torch.randn(BATCH, 2, local, 32, generator=gen) for _ in range(2))
    mine = chunk_positions(SEQ, cp, rank)
    mask = mine[:, None] >= torch.arange(SEQ)[None, :]  # (local, seq): the explicit mask of before

    def masked(qq, kk, vv):
        k_all, v_all = gather_keys_values(kk, vv, group, cp)
        return F.scaled_dot_product_attention(qq, k_all, v_all, attn_mask=mask, enable_gqa=True)

    ways = {"mask": masked,
            "gather": ChunkAttention(rank_chunks(cp, rank), None, cp, group.group_name, False).attend,
            "ring": ChunkAttention(rank_chunks(cp, rank), None, cp, group.group_name, True).attend}
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for i in range(rounds + 1):
        for name, way in ways.items():
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            dist.barrier(group)
            wall, cpu = time.perf_counter(), time.process_time()
            result = way(*inputs[:3]) if name == "mask" else way(*inputs, None)
            result.sum().backward()
            if i:  # the first round warms up
                out[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return out


def planner_row(cp: int, ring: bool = False) -> dict | None:
    """The planner's row for cp=`cp` (with `ring`: cp_ring=true) on cp devices, or None when
    its rows carry no cp."""
    fix = f"cp={cp},dp=1,tp=1,pp=1,zero=0,recompute=none,mbs={BATCH}" if cp > 1 else f"dp=1,tp=1,pp=1,recompute=none,mbs={BATCH}"
    fix += ",cp_ring=true" if ring else ""
    command = [sys.executable, "-m", "phalanx", "plan", "--model", MODEL, "--global-batch", str(BATCH), "--seq-len",
               str(SEQ), "--gpus", str(cp), "--dtype", "fp32", "--fix", fix, "--json", "--top", "1"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    if done.returncode != 0:
        return None
    plans = json.loads(done.stdout)["plans"]
    if not plans or (cp > 1 and plans[0].get("cp") != cp):
        return None
    return plans[0]


def _predicted(row: dict | None, base: dict | None, value) -> str:
    if row is None:
        return "planner: no cp yet"
    if base is None:
        return "planner: no cp=1 row"
    return f"planner {value(row):.4g} (ratio {value(row) / value(base):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per step-time row (the first is dropped)")
    parser.add_argument("--step-cp", default="1,2", help="the cp degrees of the step-time rows, comma-separated, "
                        "1 first (cp=4 runs 4 processes, more than the 2-core machine's cores)")
    parser.add_argument("--no-ring", action="store_true", help="the gather's rows only (no cp_ring=true rows)")
    parser.add_argument("--attention-rounds", type=int, default=20,
                        help="calls of each way in the attention rows (one layer, alternated; 0: no attention rows)")
    args = parser.parse_args(argv)
    schedules = (False,) if args.no_ring else (False, True)

    def rows(cps):
        """(cp, ring, plan string) of each row: cp=1, then every cp > 1 gathered and ringed."""
        return [(cp, ring, "dp=1" if cp == 1 else f"cp={cp}" + (",cp_ring=true" if ring else ""))
                for cp in cps for ring in (schedules if cp > 1 else (False,))]

    import torch

    from phalanx.testing.fork_ranks import preload_rank_imports, run_ranks

    preload_rank_imports()
    print(f"model {MODEL}, fp32, global batch {BATCH} x {SEQ} tokens, torch {torch.__version__}, gloo on CPU, "
          f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at start")
    step_cps = [int(value) for value in args.step_cp.split(",")]
    planner = {(cp, ring): planner_row(cp, ring) for cp, ring, _ in rows(sorted({1, 2, 4, *step_cps}))}
    activations = lambda row: row["memory_breakdown_gib"]["activations"] * 1024  # noqa: E731  (MiB)

    print("\nactivation memory per rank after the forward (MemTracker), MiB")
    base = None
    for cp, ring, plan in rows((1, 2, 4)):
        measured = run_ranks(cp, measure_activations, plan, timeout_s=600.0)[0] / 2**20
        base = base or measured
        print(f"  {plan:>16}: {measured:8.2f} MiB  ratio {measured / base:.3f} (1/cp = {1 / cp:.3f})   "
              f"{_predicted(planner[(cp, ring)], planner[(1, False)], activations)}", flush=True)

    if args.attention_rounds:
        print(f"\none attention layer forward + backward per rank (rank 0), median of {args.attention_rounds} calls "
              "alternated with the others; ratio against the explicit mask of before issue 38, same run")
        for cp in (2, 4):
            calls = run_ranks(cp, attention_seconds, args.attention_rounds, timeout_s=600.0)[0]
            base = [statistics.median(part) for part in zip(*calls["mask"])]
            for name, measured in calls.items():
                wall, cpu = (statistics.median(part) for part in zip(*measured))
                print(f"  cp={cp} {name:>6}: {wall * 1e3:7.1f} ms wall (ratio {wall / base[0]:.3f})  "
                      f"{cpu * 1e3:7.1f} ms CPU (ratio {cpu / base[1]:.3f})", flush=True)

    print(f"\nstep time, median of steps 2..{args.steps} (phalanx train)")
    with tempfile.TemporaryDirectory() as out:
        base = None
        for cp, ring, plan in rows(step_cps):
            times = run_ranks(cp, step_times, plan, args.steps, out, timeout_s=600.0)[0][1:]
            median = statistics.median(times)
            base = base or median
            print(f"  {plan:>16}: {median:.3f} s (spread {min(times):.3f}-{max(times):.3f})  ratio {median / base:.3f}   "
                  f"{_predicted(planner[(cp, ring)], planner[(1, False)], lambda row: row['step_time_s'])}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end (the machine is shared: timings are noisy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
