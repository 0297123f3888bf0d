"""Where a serving step's time goes: the engine driven in-process (no HTTP) through
serve_load.py's model and seeded requests, every step split into its parts, against the same
model's plain batched decode on a contiguous cache measured in the same run.

The model is serve_load.py's llama (hidden 512, 4 layers, vocabulary 4096, bytes codec; `--moe`:
its mixtral, 8 experts top 2), loaded as `phalanx serve` loads it (on CPU its matrices multiply
through oneDNN, `cpu_ops/onednn_linear.py`; `--mkl` keeps PyTorch's default MKL product), and
the requests are its closed loop: 32 seeded prompts of 16-256 tokens and outputs of 16-128,
all arriving at once, greedy with logprobs=0 (as serve_load streams them). The engine runs
with serve_load's flags (block size 16, 1024 blocks, a 512-token budget, 32 sequences), and
each new token is detokenized as the server's engine loop does (`detokenize.IncrementalText`).

Parts (explicit timers around the engine's own functions, each part's time exclusive of the
parts it calls; torch on the CPU is synchronous, so a timer measures the work):
- schedule: `Scheduler.schedule` and `Scheduler.finish_step` (the batch, blocks, prefix hashes);
- indices: the step's forwards as plain data and the cache's slot indices and masks
  (`step_forwards`, `PagedKVCache.prepare`);
- kv write / kv gather / attention: inside every layer (`PagedKVCache` and `AttentionCore`);
- model rest: the rest of the model forward (embedding, projections, MLP, norms, logits);
- sampling: picking each token and its logprobs (`Engine.sample` without the scheduler);
- detokenize: new text per token (`IncrementalText`).
Prints per part the median ms of the steps where every running sequence decodes (one token
each, 32 of them, the steady state of serve_load's closed loop) and the total over the run,
then the time of the steps with prompt chunks and of the decode-only steps per token (to
set beside serve_load.py's (a), which pays its prefill per prompt token and its TPOT per output
token), then the run's output tokens/s and the decode step against the bound: the same model's
batched forward on `phalanx generate`'s contiguous KVCache, 32 rows at the decode steps'
mean context length (no scheduling, no block tables), and what the run's projections alone
take at the bound's matmul rate (a floor for any engine with these fp32 weights). The load runs `--repeats` times, each
after a measurement of the bound, and every figure is the median over the runs: the machine
this runs on is shared, and its load moves within a run.

    .venv/bin/python benchmarks/serve_step_profile.py [--moe] [--mkl] [--threads 1] [--repeats 3] [--torch-profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_load import make_requests, write_model  # noqa: E402

PARTS = ("schedule", "indices", "kv write", "kv gather", "attention", "model rest", "sampling", "detokenize")


class Timers:
    """Exclusive time per part: a part's time excludes the timed parts it calls."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [part, began, time of timed children]

    def wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            timers._stack.append([part, time.perf_counter(), 0.0])
            try:
                return original(*args, **kwargs)
            finally:
                _, began, children = timers._stack.pop()
                spent = time.perf_counter() - began
                timers.totals[part] += spent - children
                if timers._stack:
                    timers._stack[-1][2] += spent

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        totals, self.totals = self.totals, defaultdict(float)
        return totals


def instrument(timers: Timers) -> None:
    import phalanx.serve.engine as engine_module
    from phalanx.model.attention_core import AttentionCore
    from phalanx.serve.detokenize import IncrementalText
    from phalanx.serve.paged_cache import PagedKVCache
    from phalanx.scheduling.scheduler import Scheduler
    from phalanx.serve.model_runner import ModelRunner
    from phalanx.serve.step_sampler import StepSampler

    timers.wrap(Scheduler, "schedule", "schedule")
    timers.wrap(Scheduler, "finish_step", "schedule")
    timers.wrap(engine_module, "step_message", "indices")
    timers.wrap(PagedKVCache, "prepare", "indices")
    timers.wrap(PagedKVCache, "write", "kv write")
    timers.wrap(PagedKVCache, "gather", "kv gather")
    timers.wrap(AttentionCore, "forward", "attention")
    timers.wrap(ModelRunner, "run", "model rest")
    timers.wrap(StepSampler, "sample", "sampling")
    timers.wrap(IncrementalText, "add", "detokenize")
    timers.wrap(IncrementalText, "finish", "detokenize")


def run_engine(model, requests, args, timers: Timers):
    """The closed loop in-process: per step (all decoding?, its parts, its wall time), tokens."""
    from phalanx.data.tokenizer import ByteTokenizer
    from phalanx.serve.detokenize import IncrementalText
    from phalanx.serve.engine import Engine
    from phalanx.serve.sampling_params import request_sampling
    from phalanx.scheduling.scheduler import Scheduler, Sequence

    scheduler = Scheduler(num_blocks=args.num_kv_blocks, block_size=args.block_size, max_num_seqs=args.concurrency,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_waiting=len(requests))
    engine = Engine(model, scheduler)
    decode = ByteTokenizer().decode
    for index, (prompt, out) in enumerate(requests):
        seq = Sequence.of(str(index), prompt, out, params=request_sampling(0, 1, None, 0, logprobs=0))
        seq.payload = IncrementalText(decode)
        scheduler.add(seq)
    steps, generated = [], 0
    timers.take()
    began = time.perf_counter()
    while scheduler.has_work():
        step_began = time.perf_counter()
        events = engine.step()
        for event in events:  # as the server's engine loop does with each new token
            text = event.seq.payload
            text.add(event.token)
            if event.finish_reason:
                text.finish()
        wall = time.perf_counter() - step_began
        shape = scheduler.last_step
        decoding = all(chunk.length == 1 for chunk in shape.chunks)
        context = statistics.mean(chunk.start + 1 for chunk in shape.chunks)
        steps.append((decoding, len(shape.chunks), context, timers.take(), wall, shape.num_tokens))
        generated += len(events)
    wall = time.perf_counter() - began
    assert generated == sum(out for _, out in requests), "every request generates exactly its length"
    return steps, generated, wall


@torch.no_grad()
def contiguous_decode_ms(model, batch: int, context: int, vocab: int, repeats: int) -> float:
    """The bound: `batch` rows through the model on the contiguous KVCache at `context`
    positions, one new token each, as `phalanx generate` decodes (ms per step, median)."""
    from phalanx.model.kv_cache import KVCache

    cache = KVCache(context + repeats + 1)
    prompt = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(1))
    model(prompt, cache, last_only=True)
    token = prompt[:, -1:]  # (batch, 1)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        logits = model(token, cache, last_only=True)  # (batch, 1, vocab)
        token = logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def projection_weights(model) -> int:
    """Weights that every position multiplies (the linear layers; the embedding is a lookup)."""
    return sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))


def show(runs: list, bounds: list[float], batch: int, context: int, weights: int) -> None:
    """Per part the median over every run's steps of `batch` decodes; the run's wall and
    tokens/s, and the bound, as medians over the runs (the machine may be shared)."""
    decodes = [s for steps, _, _ in runs for s in steps if s[0] and s[1] == batch]
    step_ms = statistics.median(s[4] for s in decodes) * 1000 if decodes else float("nan")
    bound_ms = statistics.median(bounds)
    print(f"{len(runs[0][0])} steps a run, {len(decodes) // len(runs)} of them {batch} decodes (mean context {context}); "
          f"medians over {len(runs)} runs")
    print(f"{'part':12} {'decode step ms':>14} {'share':>6} {'whole run s':>11}")
    for part in PARTS:
        mean = statistics.median(s[3].get(part, 0.0) for s in decodes) * 1000 if decodes else float("nan")
        total = statistics.median(sum(s[3].get(part, 0.0) for s in steps) for steps, _, _ in runs)
        print(f"{part:12} {mean:>14.2f} {mean / step_ms:>6.0%} {total:>11.2f}")
    wall = statistics.median(w for _, _, w in runs)
    generated = runs[0][1]
    print(f"{'step':12} {step_ms:>14.2f} {'':>6} {wall:>11.2f}")
    # Steps with prompt chunks against decode-only steps, per token (medians over the runs):
    # what serve_load.py's (a) pays per prompt token and per output token (its TPOT) alike.
    prefill = [(sum(s[4] for s in steps if not s[0]), sum(s[5] for s in steps if not s[0])) for steps, _, _ in runs]
    decode = [(sum(s[4] for s in steps if s[0]), sum(s[5] for s in steps if s[0])) for steps, _, _ in runs]
    for label, parts, unit in (("steps with prompt chunks", prefill, "token fed"), ("decode-only steps", decode, "output token")):
        seconds, tokens = statistics.median(t for t, _ in parts), parts[0][1]
        print(f"{label}: {seconds:.2f} s for {tokens} tokens, {seconds / tokens * 1000:.2f} ms per {unit}")
    print(f"bound: the same {batch} rows on a contiguous KVCache at context {context}: {bound_ms:.2f} ms per step")
    print(f"decode step / bound: {step_ms / bound_ms:.2f}x; whole run {generated / wall:.1f} output tok/s, "
          f"bound {batch / bound_ms * 1000:.1f} tok/s ({generated / wall / (batch / bound_ms * 1000):.2f}x of it)")
    positions = sum(s[5] for s in runs[0][0])
    rate = batch * 2 * weights / (bound_ms / 1000)  # FLOP/s of the bound's projections
    print(f"projections: {positions * 2 * weights / 1e9:.0f} GFLOP over the run ({positions} positions x 2 x "
          f"{weights / 1e6:.1f}M weights); at the bound's {rate / 1e9:.1f} GFLOP/s, {positions * 2 * weights / rate:.1f} s "
          f"alone ({generated / (positions * 2 * weights / rate):.0f} output tok/s at most)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the whole load, each after a bound measurement")
    parser.add_argument("--moe", action="store_true", help="serve_load.py --moe's mixtral (8 experts, top 2) instead")
    parser.add_argument("--mkl", action="store_true",
                        help="keep PyTorch's default CPU matmul (MKL) instead of the server's oneDNN linears")
    parser.add_argument("--torch-profile", action="store_true",
                        help="also torch.profiler's table of ops over one more run")
    args = parser.parse_args()
    # serve_load.py's model, requests and engine flags.
    args.hidden, args.layers, args.heads, args.vocab, args.quick = 512, 4, 8, 4096, False
    args.concurrency, args.block_size, args.num_kv_blocks, args.max_num_batched_tokens = args.requests, 16, 1024, 512
    if args.threads:
        torch.set_num_threads(args.threads)
    import phalanx.hf as hf

    requests = make_requests(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = hf.load(write_model(Path(tmp) / "model", args))
    if not args.mkl:  # as `phalanx serve` loads it (serve/loading.py)
        from phalanx.cpu_ops.onednn_linear import use_onednn

        use_onednn(model)
    timers = Timers()
    instrument(timers)
    steps, _, _ = run_engine(model, requests, args, timers)  # warm-up, and the decode steps' context
    decodes = [s for s in steps if s[0] and s[1] == args.concurrency]
    context = round(statistics.mean(s[2] for s in decodes)) if decodes else 128
    runs, bounds = [], []
    for _ in range(args.repeats):  # interleaved, so that a change of the machine's load hits both
        bounds.append(contiguous_decode_ms(model, args.concurrency, context, args.vocab, repeats=10))
        runs.append(run_engine(model, requests, args, timers))
    print(f"{'mixtral 8x2' if args.moe else 'llama'} hidden {args.hidden}, {args.layers} layers, {args.requests} requests (serve_load.py's, seed "
          f"{args.seed}), in-process engine, threads {args.threads or 'default'}, {'MKL' if args.mkl else 'oneDNN'} matmuls, load {os.getloadavg()[0]:.1f}")
    show(runs, bounds, args.concurrency, context, projection_weights(model))
    if args.torch_profile:
        from torch.profiler import profile

        with profile() as prof:
            run_engine(model, requests, args, Timers())
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
