"""Step time of hybrid layouts on 4 CPU ranks, pipeline bubbles, and TP overhead vs plain PyTorch.

    PYTHONPATH=. python benchmarks/hybrid_layouts.py [--steps 5] [--model small] [--seq-len 128]

Part 1 trains the `small` preset with each layout for a few steps through `phalanx.train` and
prints the median step time (first step excluded: it builds caches and process groups) and,
for pipelines, the measured bubble (time each pp rank waits on transfers / step time, averaged
over ranks) next to the schedule's formula (`phalanx.parallel.pipeline.bubble_formula`).

Part 2 compares phalanx's `tp=2` training step (its `parallelize`, then the functions
`train()` calls each step: loss in `loss_context`, backward, `clip_grad_norm`, AdamW) with the
same model tensor-parallelized directly with PyTorch (`parallelize_module` with the textbook
column/row plan, `loss_parallel`, torch's clipping, AdamW with the same two groups). Both live
on the same 2 ranks and their steps alternate on the same batches, so load from other work on
shared cores hits both alike; the median over step pairs of (phalanx / plain) should be 1.03
or less. (The
loop's own per-step bookkeeping - reading the batch, one JSON line - is outside this ratio.)

On CPU with gloo, communication is through loopback TCP and the ranks share cores, so these
numbers compare layouts with each other on this machine; they do not predict GPU speed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from phalanx.testing.fork_ranks import run_ranks

LAYOUTS = [
    "dp=4",
    "dp=4,fsdp=true",
    "dp=2,tp=2",
    "dp=2,tp=2,sp=true",
    "dp=2,pp=2",
    "tp=2,pp=2",
    "pp=4,schedule=gpipe",
    "pp=4",
    "dp=2,pp=2,schedule=interleaved,virtual=2",
    "dp=2,pp=2,schedule=zbv,virtual=2",
    "dp=2,pp=2,schedule=dualpipev,virtual=2",
]


def _phalanx_run(cfg) -> list[dict]:
    from phalanx.train.loop import train
    from phalanx.train.metrics import read_metrics

    train(cfg, Path(cfg.out))
    import torch.distributed as dist

    return read_metrics(Path(cfg.out) / "metrics.jsonl") if dist.get_rank() == 0 else []


def _plain_pytorch_tp(model_name: str, lr: float):
    """tp=2 written directly against PyTorch: the baseline for phalanx's overhead.
    Returns a function that runs one optimizer step on (inputs, targets)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    from phalanx.model.by_name import model_config
    from phalanx.model.transformer import Transformer

    cfg = model_config(model_name)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Transformer(cfg)
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
        })
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    # The usual two groups (no weight decay on norm weights), as in nanoGPT and phalanx.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        with loss_parallel():
            loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
            loss.backward()
        # torch's clip_grad_norm_ refuses a mix of DTensor (sharded) and plain (norm) grads,
        # so the plain way is its two halves: total norm per kind, then one clip.
        sharded = [p.grad for p in model.parameters() if isinstance(p.grad, DTensor)]
        replicated = [p.grad for p in model.parameters() if not isinstance(p.grad, DTensor)]
        norm = torch.nn.utils.get_total_norm(sharded).full_tensor().hypot(torch.nn.utils.get_total_norm(replicated))
        torch.nn.utils.clip_grads_with_norm_(sharded, 1.0, norm)
        torch.nn.utils.clip_grads_with_norm_(replicated, 1.0, norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach().full_tensor())

    return step


def _phalanx_tp(model_name: str, lr: float):
    """phalanx's tp=2: its `parallelize`, and one step made of the functions `train()` calls."""
    import contextlib

    import torch.distributed as dist

    from phalanx.model.by_name import model_config
    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.grad_norm import clip_grad_norm
    from phalanx.parallel.mesh import build_mesh
    from phalanx.parallel.tensor_parallel import loss_context
    from phalanx.plan import plan_from_string
    from phalanx.train.loop import batch_loss

    mesh = build_mesh(plan_from_string("tp=2", dist.get_world_size()), torch.device("cpu"))
    model = parallelize(model_config(model_name), mesh, seed=0)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        with loss_context(mesh.plan):
            loss = batch_loss(model, inputs, targets, contextlib.nullcontext)
            loss.backward()
        clip_grad_norm(model.parameters(), 1.0, pp_group=mesh.group("pp"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(mesh.all_reduce_mean(loss.detach().full_tensor()))

    return step


def _alternate_tp_steps(model_name: str, steps: int, global_batch: int, seq_len: int) -> tuple[list, list]:
    """Both models on the same 2 ranks, steps alternating (phalanx, plain, phalanx, ...) on the
    same batches, so both see the same load from whatever else shares the cores."""
    from phalanx.model.by_name import model_config

    ours, plain = _phalanx_tp(model_name, 3e-3), _plain_pytorch_tp(model_name, 3e-3)
    vocab = model_config(model_name).vocab_size
    data = torch.randint(0, vocab, (steps, global_batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    times: tuple[list, list] = ([], [])
    for index in range(steps):
        inputs, targets = data[index, :, :-1], data[index, :, 1:]
        order = (0, 1) if index % 2 == 0 else (1, 0)  # neither side always goes first
        for side in order:
            began = time.perf_counter()
            (ours, plain)[side](inputs, targets)
            times[side].append(time.perf_counter() - began)
    return times


def _median(values: list[float]) -> float:
    return statistics.median(values[1:]) if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--skip-layouts", action="store_true", help="only the tp=2 comparison")
    parser.add_argument("--tp-steps", type=int, default=24, help="steps of each side in the tp=2 comparison")
    args = parser.parse_args()

    from phalanx.train.config import TrainConfig

    base = TrainConfig(
        model=args.model, steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len, warmup_steps=1,
        eval_every=0, ckpt_every=0, sample_tokens=0, progress=False, device="cpu",
    )
    scratch = Path(tempfile.mkdtemp(prefix="phalanx-bench-"))
    print(f"model {args.model}, global batch {args.global_batch} x {args.seq_len} tokens, {args.steps} steps "
          f"(median of steps 2..{args.steps}), torch {torch.__version__}, gloo on CPU")
    print(f"\n{'layout (4 ranks)':<44} {'step s':>7} {'tok/s':>7} {'bubble':>7} {'formula':>8}")
    for plan in [] if args.skip_layouts else LAYOUTS:
        cfg = base.replace(plan=plan, out=str(scratch / plan.replace(",", "_")))
        records = run_ranks(4, _phalanx_run, cfg, timeout_s=600)[0]
        step = _median([r["step_time_s"] for r in records])
        line = f"{plan:<44} {step:7.3f} {args.global_batch * args.seq_len / step:7.0f}"
        if "bubble_formula" in records[0]:
            bubble = _median([r["bubble"] for r in records])
            line += f" {bubble:7.2f} {records[0]['bubble_formula']:8.2f}"
        print(line, flush=True)

    print("\ntp=2 on 2 ranks: phalanx vs parallelize_module written directly, steps alternating")
    ours, plain = run_ranks(2, _alternate_tp_steps, args.model, args.tp_steps, args.global_batch, args.seq_len,
                            timeout_s=600)[0]
    ours, plain = ours[2:], plain[2:]  # the first steps build DTensor sharding caches
    # Each phalanx step is paired with the plain step run right next to it; the median of the
    # pairs' ratios cancels slow spells of the shared machine better than a ratio of medians.
    ratio = statistics.median(a / b for a, b in zip(ours, plain))
    print(f"  median step: phalanx {statistics.median(ours):.3f} s, plain PyTorch {statistics.median(plain):.3f} s "
          f"over {len(ours)} steps each (fastest {min(ours):.3f} / {min(plain):.3f}; "
          f"ratio of medians {statistics.median(ours) / statistics.median(plain):.3f})")
    print(f"phalanx tp=2 / plain PyTorch tp=2 = {ratio:.3f} (median of paired steps; "
          f"{'meets' if ratio <= 1.03 else 'misses'} the 1.03 target)")

if __name__ == "__main__":
    main()
