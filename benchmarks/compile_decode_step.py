"""Would a `torch.compile`d decode step serve faster on this CPU? (issue 37: "one compiled decode
step per batch-size bucket"). A serving decode step of the ~100M llama (`--hidden 768 --layers
12`, vocabulary 2048, fp32, as serve_vs_vllm.py's) four ways, alternating step by step in one
process, so that a drifting machine hits every arm alike:

- eager: what `phalanx serve` runs on the CPU: the model's Python forward, its linears through
  oneDNN's blocked copies (`cpu_ops/onednn_linear.py`), the paged cache (`serve/paged_cache.py`)
  with decodes read from the pool by the C kernel (`cpu_ops/decode_kernel.py`);
- compiled, oneDNN linears: the same model compiled whole (inductor, `fullgraph=True`, one graph
  per batch size: the bucket), the step's cache state in tensors only (positions, write slots,
  each sequence's slots and key range) and three opaque custom ops: the KV write (mutating the
  pool in place), the C decode kernel, and the blocked oneDNN linear, so that inductor fuses
  everything around them (norms, rotary, SiLU, residual adds) into its own C++ loops;
- compiled, inductor's linears: the same, with inductor lowering the linears itself (freezing:
  the weights folded into the graph and packed; on the CPU in fp32, for a fixed batch, that is
  MKL's packed sgemm);
- `phalanx serve --compile` (`serve/compiled_decode.py`): the same ops, the weights frozen, and
  the batch symbolic, for which inductor packs the weights for oneDNN instead (one graph for
  every batch size; a batch of one runs as two identical rows).

Each arm's logits are checked against eager's first (within 1e-4 of the largest). Prints the
median and fastest step per arm and batch size, each compiled arm's ratio to eager from the same
run, and the compile time of each bucket (inductor's cache in a fresh temporary directory); then, from
torch's profiler over ten eager steps, the share of their CPU time in the linears' oneDNN calls,
which no compiler fuses away.

Reproduce:  .venv/bin/python benchmarks/compile_decode_step.py [--threads 1] [--batches 1 8 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phalanx.cpu_ops import decode_kernel  # noqa: E402
from phalanx.cpu_ops.onednn_linear import block, onednn_linear, use_onednn  # noqa: E402
from phalanx.model.config import ModelConfig  # noqa: E402
from phalanx.model.transformer import Transformer  # noqa: E402
from phalanx.serve.compiled_decode import CompiledDecode, TensorDecodeCache  # noqa: E402
from phalanx.serve.paged_cache import ChunkLayout, PagedKVCache  # noqa: E402

SERVED = "phalanx serve --compile"
BLOCK = 16
CONTEXT = 300
"""Positions each sequence holds when the timed decodes start (serve_vs_vllm's 256-token prompts
plus some output)."""


_BLOCKED: dict[int, torch.Tensor] = {}


@torch.library.custom_op("phalanx_bench::blocked_linear", mutates_args=())
def blocked_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN's blocked copy of `weight` (made on its first product)."""
    if weight.data_ptr() not in _BLOCKED:
        _BLOCKED[weight.data_ptr()] = block(weight)
    return onednn_linear(x, _BLOCKED[weight.data_ptr()])


@blocked_linear.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class OpaqueLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blocked_linear(x, self.weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per arm and batch size")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="phalanx-inductor-")
    torch.set_num_threads(args.threads)
    if not decode_kernel.usable(torch.device("cpu"), torch.float32):
        sys.exit("the CPU decode kernel is not available here (no C compiler?): nothing to compare")
    cfg = ModelConfig(vocab_size=2048, dim=args.hidden, n_layers=args.layers, n_heads=args.hidden // 64,
                      n_kv_heads=args.hidden // 128, ffn_dim=4 * args.hidden, max_seq_len=1024)
    torch.manual_seed(0)
    eager = Transformer(cfg).eval()
    opaque, lowered = Transformer(cfg).eval(), Transformer(cfg).eval()
    for model in (opaque, lowered):
        model.load_state_dict(eager.state_dict())
    use_onednn(eager, blocked=True)
    served = CompiledDecode(eager)  # what `phalanx serve --compile` runs, over the eager arm's own model
    for module in opaque.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = OpaqueLinear

    print(f"llama hidden {args.hidden} x {args.layers} layers, fp32, {args.threads} thread(s), torch {torch.__version__}, "
          f"decodes at {CONTEXT}+ positions, {args.steps} steps per arm, arms alternated step by step")
    print(f"{'batch':>5}  {'arm':34s} {'median ms':>9} {'fastest':>8} {'eager/arm':>9} {'compile s':>9}")
    for batch in args.batches:
        run_batch(batch, args.steps, cfg, eager, opaque, lowered, served)


def run_batch(batch: int, steps: int, cfg, eager, opaque, lowered, served) -> None:
    blocks_per_seq = -(-(CONTEXT + steps + 4) // BLOCK)
    cache = PagedKVCache(batch * blocks_per_seq, BLOCK, "cpu", ragged=True, pool_kernel=True)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    generator = torch.Generator().manual_seed(batch)
    with torch.no_grad():
        for table in tables:  # each sequence's prompt, through the eager path
            cache.prepare([ChunkLayout(table, 0, CONTEXT)])
            eager(torch.randint(0, cfg.vocab_size, (1, CONTEXT), generator=generator), cache,
                  read_at=torch.tensor([CONTEXT - 1]))
    slots = torch.tensor([[b * BLOCK + o for b in table for o in range(BLOCK)] for table in tables])
    tokens = torch.randint(0, cfg.vocab_size, (batch, 1), generator=generator)

    def tensor_cache(position: int) -> TensorDecodeCache:
        return TensorDecodeCache(cache.pools, torch.full((batch, 1), position), slots[:, position].contiguous(), slots,
                                 torch.full((batch,), position + 1))

    def eager_step(position: int) -> torch.Tensor:
        cache.prepare([ChunkLayout(table, position, 1) for table in tables])
        return eager(tokens, cache)

    def served_step(position: int) -> torch.Tensor:
        cache.prepare([ChunkLayout(table, position, 1) for table in tables])
        return served(tokens, cache)

    torch._inductor.config.freezing = False
    compiled_opaque = torch.compile(opaque, fullgraph=True, dynamic=False)
    arms = {"eager (phalanx serve)": eager_step}
    compile_s = {}
    with torch.no_grad():
        want = eager_step(CONTEXT)
        for name, model, freezing in (("compiled, oneDNN linears as ops", compiled_opaque, False),
                                      ("compiled, inductor's linears", lowered, True)):
            torch._inductor.config.freezing = freezing
            compiled = model if model is compiled_opaque else torch.compile(model, fullgraph=True, dynamic=False)
            began = time.perf_counter()
            got = compiled(tokens, tensor_cache(CONTEXT))  # compiles this bucket; rewrites the same slots
            compile_s[name] = time.perf_counter() - began
            if float((got - want).abs().max()) > 1e-4 * float(want.abs().max()):
                sys.exit(f"{name}: logits differ from eager's by {float((got - want).abs().max()):.3g}")
            arms[name] = lambda position, compiled=compiled: compiled(tokens, tensor_cache(position))
        began = time.perf_counter()
        got = served_step(CONTEXT)  # compiles on the first batch size only: its batch is symbolic
        compile_s[SERVED] = time.perf_counter() - began
        if float((got - want).abs().max()) > 1e-4 * float(want.abs().max()):
            sys.exit(f"{SERVED}: logits differ from eager's by {float((got - want).abs().max()):.3g}")
        arms[SERVED] = served_step
        times: dict[str, list[float]] = {name: [] for name in arms}
        names = list(arms)
        for step in range(steps):
            position = CONTEXT + 1 + step
            order = names if step % 2 == 0 else names[::-1]
            for name in order:  # every arm writes the same keys to the same slots
                began = time.perf_counter()
                arms[name](position)
                times[name].append(time.perf_counter() - began)
        linear_share = linear_cpu_share(eager_step, CONTEXT + 1 + steps)
    base = statistics.median(times[names[0]])
    for name in names:
        median = statistics.median(times[name])
        built = f"{compile_s[name]:9.1f}" if name in compile_s else f"{'':9s}"
        print(f"{batch:5d}  {name:34s} {median * 1e3:9.2f} {min(times[name]) * 1e3:8.2f} {base / median:9.3f} {built}")
    print(f"{batch:5d}  eager step: {100 * linear_share:.0f}% of its CPU time in the linears' oneDNN calls "
          "(what compiling cannot fuse)")


def linear_cpu_share(eager_step, position: int, steps: int = 10) -> float:
    """The share of the eager steps' CPU time (torch's profiler, self time per op) spent in
    oneDNN's linear."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for step in range(steps):
            eager_step(position + step)
    events = profile.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    return sum(event.self_cpu_time_total for event in events if event.key == "mkldnn::_linear_pointwise") / total


if __name__ == "__main__":
    main()
