"""One MoE layer, expert-parallel over 2 gloo ranks: phalanx against DeepSpeed's `MoE`.

Run (after `bash benchmarks/setup_deepspeed_venv.sh`), from the repository root:

    PYTHONPATH=. benchmarks/.venv-deepspeed/bin/python benchmarks/moe_vs_deepspeed.py [--grain coarse|fine|both]

Two shapes ("grains"; default both, one after the other):
  * coarse: 8 SwiGLU experts, dim 256, hidden 512, softmax top-2 (Mixtral-like);
  * fine: 64 SwiGLU experts, dim 256, hidden 128, softmax top-8 (DeepSeek-like: many small
    experts, many per token), so each expert sees few rows and per-expert overheads count.
Both sides get the same layer: renormalized top-k weights, ep=2 on 2 ranks, no token dropping,
the same gate and expert weights and the same input rows per rank. DeepSpeed is built with
drop_tokens=False; at top-2 also use_rts=False and top2_2nd_expert_sampling=False (so its
second expert is the deterministic argmax); for k > 2 its `TopKGate` calls `topkgating`, which
is deterministic already: softmax, `torch.topk`, weights renormalized over the k chosen, and
without dropping a capacity equal to the busiest expert's count over the ep group. Each rank
runs one thread. Timed: forward + backward of the layer (both all-to-alls, the experts, the
gate), tokens/s over both ranks, repeats interleaved (phalanx, DeepSpeed, phalanx, ...) so
that load from other processes hits both sides alike. The ratio uses each side's fastest
repeat: on shared cores, noise only ever adds time, so the fastest repeat is the best
estimate of the cost itself; medians are printed beside it.

Routing semantics are checked before timing: per rank, the per-expert assignment counts of
both sides must be identical (same experts chosen), and the outputs must agree to 1e-4
absolute (fp32; the same products summed in another grouping).

Two routings: "near-uniform" (random gate and inputs) and "skewed" (inputs share a direction
that two experts' gate rows favour; the busiest expert's count is printed as a multiple of the
mean and must be >= 2). DeepSpeed pads every expert to the busiest expert's count, so its
work grows with skew; phalanx computes exactly the routed rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

EP = 2
TOKENS_PER_RANK = 4096
WARMUP, REPEATS = 2, 9


@dataclass(frozen=True)
class Shape:
    """One layer shape and the ratios phalanx must reach there (issue 13's targets)."""

    experts: int
    dim: int
    hidden: int
    top_k: int
    target_uniform: float
    target_skewed: float


GRAINS = {
    "coarse": Shape(experts=8, dim=256, hidden=512, top_k=2, target_uniform=1.05, target_skewed=1.5),
    "fine": Shape(experts=64, dim=256, hidden=128, top_k=8, target_uniform=1.05, target_skewed=2.0),
}


class SwiGLU(nn.Module):
    """DeepSpeed's expert module: the same math as one slice of phalanx's GroupedExperts."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _shared_weights(shape: Shape, skewed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    e, dim, hidden = shape.experts, shape.dim, shape.hidden
    weights = {
        "gate": torch.randn(e, dim, generator=g) * 0.05,
        "w1": torch.randn(e, hidden, dim, generator=g) * 0.05,
        "w2": torch.randn(e, dim, hidden, generator=g) * 0.05,
        "w3": torch.randn(e, hidden, dim, generator=g) * 0.05,
        "direction": torch.nn.functional.normalize(torch.randn(dim, generator=g), dim=0),
    }
    if skewed:  # experts 0 and 1 like the shared input direction
        weights["gate"][:2] += 0.25 * weights["direction"]
    return weights


def _inputs(rank: int, skewed: bool, direction: torch.Tensor) -> torch.Tensor:
    x = torch.randn(TOKENS_PER_RANK, direction.numel(), generator=torch.Generator().manual_seed(100 + rank))
    return x + 6.0 * direction if skewed else x


def _phalanx_layer(shape: Shape, w, rank):
    from phalanx.model.config import ModelConfig
    from phalanx.model.moe import MoE
    from phalanx.parallel.expert import shard_experts
    import torch.distributed as dist

    cfg = ModelConfig(name="bench", dim=shape.dim, n_heads=4, n_kv_heads=4, n_experts=shape.experts,
                      experts_per_token=shape.top_k, expert_ffn_dim=shape.hidden)
    layer = MoE(cfg)
    with torch.no_grad():
        layer.router.gate.weight.copy_(w["gate"])
        for name in ("w1", "w2", "w3"):
            getattr(layer.experts, name).copy_(w[name])
        layer.router.reset_buffers()
    layer.experts = shard_experts(layer.experts, dist.group.WORLD, rank, EP)
    return layer


def _deepspeed_layer(shape: Shape, w, rank):
    import deepspeed
    from deepspeed.moe.layer import MoE

    deepspeed.init_distributed(dist_backend="gloo")
    layer = MoE(
        hidden_size=shape.dim, expert=SwiGLU(shape.dim, shape.hidden), num_experts=shape.experts, ep_size=EP,
        k=shape.top_k, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False, min_capacity=0,
    )  # use_rts and top2_2nd_expert_sampling act at k <= 2 only; topkgating (k > 2) has neither
    layer.set_deepspeed_parallelism()  # outside deepspeed.initialize, the ep groups need this
    n_local = shape.experts // EP
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(w["gate"])
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            for name in ("w1", "w2", "w3"):
                getattr(expert, name).weight.copy_(w[name][rank * n_local + i])
    return layer


def _time(layer, x, upstream, is_deepspeed: bool) -> float:
    import torch.distributed as dist

    dist.barrier()
    began = time.perf_counter()
    out = layer(x)[0] if is_deepspeed else layer(x)
    (out * upstream).sum().backward()
    dist.barrier()
    layer.zero_grad(set_to_none=True)
    return time.perf_counter() - began


def _bench(shape: Shape, skewed: bool) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    w = _shared_weights(shape, skewed)
    x = _inputs(rank, skewed, w["direction"])
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + rank))
    ours, theirs = _phalanx_layer(shape, w, rank), _deepspeed_layer(shape, w, rank)

    # Same routing: identical per-expert counts on this rank's tokens, and the same outputs.
    ours.tokens_per_expert = None
    out_ours = ours(x)
    out_theirs, _, counts_theirs = theirs(x)
    counts_ours = ours.tokens_per_expert
    same_experts = torch.equal(counts_ours.cpu(), counts_theirs.cpu().to(counts_ours.dtype))
    max_diff = float((out_ours - out_theirs).detach().abs().max())
    counts = counts_ours.clone().float()
    dist.all_reduce(counts)  # global per-expert load, for the skew report

    for _ in range(WARMUP):
        _time(ours, x, upstream, False), _time(theirs, x, upstream, True)
    times = {"phalanx": [], "deepspeed": []}
    for _ in range(REPEATS):
        times["phalanx"].append(_time(ours, x, upstream, False))
        times["deepspeed"].append(_time(theirs, x, upstream, True))
    return {
        "same_experts": same_experts, "max_diff": max_diff, "counts": counts.tolist(),
        "seconds": {k: min(v) for k, v in times.items()},
        "median_seconds": {k: statistics.median(v) for k, v in times.items()},
    }


def _measure(grain: str, shape: Shape) -> list[str]:
    """Both routings at one shape; prints the figures and returns the targets missed."""
    from phalanx.testing.fork_ranks import run_ranks

    print(f"\n== {grain} grain: {shape.experts} experts, dim {shape.dim}, hidden {shape.hidden}, top-{shape.top_k}")
    failures = []
    for name, skewed, target in (("near-uniform", False, shape.target_uniform), ("skewed", True, shape.target_skewed)):
        results = run_ranks(EP, _bench, shape, skewed, timeout_s=600, preload=False)  # a layer, no training
        counts = torch.tensor(results[0]["counts"])
        skew = float(counts.max() / counts.mean())
        sides = ("phalanx", "deepspeed")
        rate = {side: EP * TOKENS_PER_RANK / max(r["seconds"][side] for r in results) for side in sides}
        median = {side: EP * TOKENS_PER_RANK / max(r["median_seconds"][side] for r in results) for side in sides}
        ratio = rate["phalanx"] / rate["deepspeed"]
        same = all(r["same_experts"] for r in results)
        diff = max(r["max_diff"] for r in results)
        shown = counts.int().tolist() if shape.experts <= 16 else f"min {int(counts.min())}, max {int(counts.max())}"
        print(f"\n{name}: busiest expert = {skew:.2f} x mean load; per-expert tokens {shown}")
        print(f"  same experts chosen on every rank: {same}; max |output difference| = {diff:.2e}")
        for side in sides:
            print(f"  {side:<9} {rate[side]:>9,.0f} tokens/s fastest, {median[side]:>9,.0f} median")
        print(f"  ratio phalanx/deepspeed = {ratio:.2f}x fastest (target >= {target}x), "
              f"{median['phalanx'] / median['deepspeed']:.2f}x median")
        label = f"{grain} {name}"
        if not same or diff > 1e-4:
            failures.append(f"{label}: routing differs (same experts: {same}, max diff {diff:.1e})")
        if skewed and skew < 2.0:
            failures.append(f"{label}: busiest expert only {skew:.2f}x the mean, the setup is not skewed enough")
        if ratio < target:
            failures.append(f"{label}: ratio {ratio:.2f}x below the {target}x target")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grain", choices=(*GRAINS, "both"), default="both",
                        help="layer shape: coarse (8 experts, top-2), fine (64 experts, top-8), or both (default)")
    grains = list(GRAINS) if (grain := parser.parse_args(argv).grain) == "both" else [grain]

    import deepspeed

    print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}; ep={EP} on {EP} gloo ranks x 1 thread, "
          f"{TOKENS_PER_RANK} tokens/rank, forward+backward, {REPEATS} interleaved repeats")
    failures = [failure for grain in grains for failure in _measure(grain, GRAINS[grain])]
    print("\n" + ("all targets met" if not failures else "NOT MET:\n  " + "\n  ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
