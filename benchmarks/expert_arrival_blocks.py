"""Experts on expert-parallel arrivals, forward + backward, one thread: block by block vs regrouped.

    PYTHONPATH=. python benchmarks/expert_arrival_blocks.py

Under expert parallelism a rank receives its rows in (source rank, local expert) blocks.
`ShardedExperts` can compute them three ways (phalanx/parallel/expert.py):
  * blocks: the per-expert loop on each block where it lies (no permutation);
  * regroup + loop: rows permuted to expert order, the loop, the permutation undone;
  * regroup + grouped_mm: the same around one `torch._grouped_mm` per weight.
A fourth, "regroup + slice loop", is the loop as it was before it took each expert's weights
by `unbind`: indexing `w[e]` has a backward that materializes a zero gradient of the whole
stack per expert and adds them up. Same rows, counts and weights for all; counts drawn
within +-20% of the block size; repeats interleaved (A B C D, D C B A) so all see the same
load; prints each one's fastest repeat (noise on shared cores only adds time). The outputs
and gradients of all four are checked to agree (1e-4) before timing.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from phalanx.model.moe import grouped_expert_ffn, grouped_mm_expert_ffn, grouped_mm_works
from phalanx.parallel.expert_dispatch import DispatchPlan, regroup_by_expert

SHAPES = [(2, 32, 128, 512), (2, 32, 128, 128), (4, 16, 128, 256), (8, 8, 128, 64), (2, 4, 512, 1024)]
"""(ep, local experts, hidden, rows per block); dim 256. The first is moe_vs_deepspeed.py's fine
grain near-uniform (64 experts, top-8, 4096 tokens per rank, ep=2), the last its coarse grain."""
DIM, REPEATS = 256, 4


def _slice_loop(x, counts, w1, w2, w3):
    outputs = []
    for expert, rows in enumerate(torch.split(x, counts)):
        hidden = F.silu(rows @ w1[expert].t()) * (rows @ w3[expert].t())  # (rows, hidden)
        outputs.append(hidden @ w2[expert].t())  # (rows, dim)
    return torch.cat(outputs)


def _regrouped(ffn, host_counts: bool):
    def run(arrived, plan, w1, w2, w3):
        rows, counts = regroup_by_expert(arrived, plan)
        out = ffn(rows, plan.local_counts if host_counts else counts, w1, w2, w3)
        return torch.empty_like(out).index_copy(0, plan.regroup, out)  # back to arrival order

    return run


def _blocks(arrived, plan, w1, w2, w3):
    return grouped_expert_ffn(arrived, plan.block_counts, w1, w2, w3, experts=plan.block_experts)


def one_case(ep: int, n_local: int, hidden: int, per_block: int) -> None:
    generator = torch.Generator().manual_seed(0)
    recv_counts = torch.randint(int(per_block * 0.8), int(per_block * 1.2) + 1, (ep, n_local), generator=generator)
    rows = int(recv_counts.sum())
    arrived = torch.randn(rows, DIM, generator=generator)
    weights = [torch.randn(n_local, hidden, DIM, generator=generator) / DIM**0.5,
               torch.randn(n_local, DIM, hidden, generator=generator) / hidden**0.5,
               torch.randn(n_local, hidden, DIM, generator=generator) / DIM**0.5]
    upstream = torch.randn(rows, DIM, generator=generator)
    runs = {"blocks": _blocks, "regroup + loop": _regrouped(grouped_expert_ffn, True),
            "regroup + slice loop": _regrouped(_slice_loop, True)}
    if grouped_mm_works(arrived, weights[0]):
        runs["regroup + grouped_mm"] = _regrouped(grouped_mm_expert_ffn, False)

    def step(name: str):
        plan = DispatchPlan(send=[], recv=[], block_counts=recv_counts.reshape(-1).tolist(), recv_counts=recv_counts)
        x = arrived.clone().requires_grad_(True)
        leaves = [w.clone().requires_grad_(True) for w in weights]
        began = time.perf_counter()
        out = runs[name](x, plan, *leaves)
        grads = torch.autograd.grad(out, [x, *leaves], upstream)
        return time.perf_counter() - began, [out.detach(), *grads]

    reference = step("blocks")[1]
    for name in runs:
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(reference, step(name)[1])), name
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(REPEATS):
        for name in [*runs, *reversed(runs)]:
            seconds[name].append(step(name)[0])
    print(f"ep={ep} local experts={n_local} hidden={hidden} ~{per_block} rows per block ({rows} rows): "
          + ", ".join(f"{name} {min(times) * 1e3:.1f} ms" for name, times in seconds.items()))


def main() -> None:
    torch.set_num_threads(1)  # as each rank of the DeepSpeed comparison runs
    for shape in SHAPES:
        one_case(*shape)


if __name__ == "__main__":
    main()
