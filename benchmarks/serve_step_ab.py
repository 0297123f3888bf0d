"""Two ways of running the same serving engine, compared step by step: each engine step of
serve_load.py's closed loop runs one way or the other in turn, so that both see the same
batches and the same moments of a shared, drifting machine.

Comparing whole runs one after another, the closed loop's throughput moved by 10-30% between
consecutive runs of the same code on the machine of 2026-12-02 (2 cores of an AMD EPYC in a
VM); a change worth 5% could not be told from noise. Here the run is done twice, steps
0, 2, 4, ... one way and 1, 3, 5, ... the other, then the other way round, so each step index
is timed both ways; the ratio is the summed step time of A over that of B (above 1: B is
faster). A null comparison (A and B the same code) printed 0.987-1.02 over five pairs.

Variants (A against B), on serve_load.py's model (`--llama`: its llama, else its mixtral) and
requests, loaded as `phalanx serve` loads it:
- `blocked`: oneDNN given the plain weights against its blocked copies (`onednn_linear.py`);
- `fused-gate-up`: the routed experts' blocked copies one per weight (gate, up, down), each
  looked up per product as a linear layer's is, against `BlockedExperts` (gate and up stacked,
  one product, one lookup per copy);
- `norm`: RMSNorm through its autograd function (as training runs it) against its inference
  path (`model/rms_norm.py`);
- `combine`: the MoE layer's weighted sum of expert outputs through `WeightedCombine` against
  `moe.combine`'s inference path;
- `decode-kernel`: decodes' keys gathered for the flash kernel against read straight from the
  pool by the CPU kernel (`cpu_ops/decode_kernel.py`);
- `null`: the same code both ways (the harness's own spread).

    .venv/bin/python benchmarks/serve_step_ab.py --variant fused-gate-up [--pairs 5] [--llama]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_load import make_requests, write_model  # noqa: E402


class SeparateBlockedExperts:
    """`BlockedExperts`' interface with one blocked copy per weight, each looked up per product as
    a linear layer's is (`BlockedWeight`): gate and up as two products."""

    def __init__(self, experts):
        from phalanx.cpu_ops.onednn_linear import BlockedWeight

        self.weights = {(name, e): BlockedWeight() for name in ("w1", "w2", "w3") for e in range(experts.w1.shape[0])}

    def ffn(self, rows, expert, w1, w2, w3):
        weights = self.weights
        hidden = F.silu(weights["w1", expert].linear(rows, w1[expert])) * weights["w3", expert].linear(rows, w3[expert])
        return weights["w2", expert].linear(hidden, w2[expert])


def variant(name: str, model):
    """A function of one bool: False sets the model up as A, True as B."""
    from phalanx.model.moe import GroupedExperts

    if name == "null":
        return lambda b: None
    if name == "decode-kernel":
        from phalanx.serve import paged_cache

        # Each run builds a new cache (serve_step_ab's run()), which reads the flag; so the
        # kernel is switched per step through the cache class, not per run.
        prepare = paged_cache.PagedKVCache.prepare

        def toggle(b: bool) -> None:
            def switched(self, chunks):
                self.pool_kernel = b and self.ragged
                return prepare(self, chunks)
            paged_cache.PagedKVCache.prepare = switched
        return toggle
    if name == "combine":
        from phalanx.model import moe

        inference = moe.combine

        def toggle(b: bool) -> None:
            moe.combine = inference if b else moe.WeightedCombine.apply
        return toggle
    if name == "norm":
        from phalanx.model import rms_norm

        inference = rms_norm.RMSNorm.forward

        def through_function(self, x):
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            return rms_norm._RMSNormFunction.apply(x, self.weight, eps)

        def toggle(b: bool) -> None:
            rms_norm.RMSNorm.forward = inference if b else through_function
        return toggle
    if name == "blocked":
        held = {m: m.blocked for m in model.modules() if getattr(m, "blocked", None) is not None}
        if not held:
            sys.exit("no blocked copies were kept here (blocked_copies_fit, blocking_works)")

        def toggle(b: bool) -> None:
            for module, copies in held.items():
                module.blocked = copies if b else None
        return toggle
    if name == "fused-gate-up":
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts) and m.blocked is not None]
        if not experts:
            sys.exit("no routed experts with blocked copies here (a MoE model, blocked_copies_fit)")
        fused = {m: m.blocked for m in experts}
        separate = {m: SeparateBlockedExperts(m) for m in experts}

        def toggle(b: bool) -> None:
            for module in experts:
                module.blocked = fused[module] if b else separate[module]
        return toggle
    raise SystemExit(f"unknown variant {name!r}")


def run(model, requests, toggle, phase: int) -> dict[bool, float]:
    """The closed loop once, step k run as B when (k + phase) is odd: summed step times of A, B."""
    from phalanx.serve.engine import Engine
    from phalanx.serve.sampling_params import request_sampling
    from phalanx.scheduling.scheduler import Scheduler, Sequence

    scheduler = Scheduler(num_blocks=1024, block_size=16, max_num_seqs=len(requests), max_num_batched_tokens=512,
                          max_waiting=len(requests))
    engine = Engine(model, scheduler)
    for index, (prompt, out) in enumerate(requests):
        scheduler.add(Sequence.of(str(index), prompt, out, params=request_sampling(0, 1, None, 0, logprobs=0)))
    times, step = {False: 0.0, True: 0.0}, 0
    while scheduler.has_work():
        b = (step + phase) % 2 == 1
        toggle(b)
        began = time.perf_counter()
        engine.step()
        times[b] += time.perf_counter() - began
        step += 1
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, choices=["blocked", "combine", "decode-kernel", "fused-gate-up", "norm", "null"])
    parser.add_argument("--pairs", type=int, default=5, help="pairs of runs (each step index timed both ways per pair)")
    parser.add_argument("--llama", action="store_true", help="serve_load.py's llama instead of its mixtral")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # serve_load.py's model and requests (its closed loop of 32).
    args.hidden, args.layers, args.heads, args.vocab, args.quick = 512, 4, 8, 4096, False
    args.moe, args.requests = not args.llama, 32
    import phalanx.hf as hf
    from phalanx.cpu_ops.onednn_linear import use_onednn

    requests = make_requests(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = hf.load(write_model(Path(tmp) / "model", args))
    use_onednn(model)  # as `phalanx serve` loads it (serve/loading.py)
    toggle = variant(args.variant, model)
    with torch.no_grad():
        run(model, requests, toggle, 0)  # warm-up: both ways' kernels and copies made
        run(model, requests, toggle, 1)
        ratios = []
        for _ in range(args.pairs):
            first, second = run(model, requests, toggle, 0), run(model, requests, toggle, 1)
            ratios.append((first[False] + second[False]) / (first[True] + second[True]))
    print(f"{'llama' if args.llama else 'mixtral 8x2'} hidden 512, 4 layers, serve_load.py's 32 requests, "
          f"{torch.get_num_threads()} threads; variant {args.variant}")
    print(f"step time A / B per pair of runs: {' '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f} (above 1: B is faster)")


if __name__ == "__main__":
    main()
