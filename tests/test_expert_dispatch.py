"""Dispatch then combine over an ep group is exact, forward and backward, whatever the routing.

All-to-all only moves rows: no arithmetic touches them, so the round trip must return the
input bit for bit (tolerance 0), and so must the gradient (the backward is the reverse
all-to-all). Each rank also checks that it received exactly the rows for its own experts, in
(local expert, source rank, source order) order, by comparing with every rank's inputs, which
all ranks can rebuild from the shared seed. Routing cases: random, skewed (every row to
rank 0's first expert: other ranks receive nothing), and one rank sending nothing at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from phalanx.parallel.expert_dispatch import combine, dispatch
from phalanx.testing.fork_ranks import run_ranks

N_EXPERTS, DIM = 8, 4


def _rank_input(rank: int, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert, and the count per expert, that `rank` sends in `case`."""
    generator = torch.Generator().manual_seed(100 + rank)
    n_rows = {"random": 13 + 5 * rank, "skewed": 9, "silent_rank": 0 if rank == 1 else 11}[case]
    if case == "skewed":
        experts = torch.zeros(n_rows, dtype=torch.long)
    else:
        experts = torch.randint(0, N_EXPERTS, (n_rows,), generator=generator).sort().values
    rows = torch.randn(n_rows, DIM, generator=generator, dtype=torch.float64)
    return rows, torch.bincount(experts, minlength=N_EXPERTS)


def _round_trip(case: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, counts = _rank_input(rank, case)
    rows.requires_grad_(True)
    received, local_counts, plan = dispatch(rows, counts, dist.group.WORLD)

    # What this rank should have received: for each local expert, each source's rows for it.
    n_local = N_EXPERTS // world
    expected, expected_counts = [], []
    for expert in range(rank * n_local, (rank + 1) * n_local):
        for source in range(world):
            src_rows, src_counts = _rank_input(source, case)
            start = int(src_counts[:expert].sum())
            expected.append(src_rows[start : start + int(src_counts[expert])])
        expected_counts.append(sum(int(_rank_input(s, case)[1][expert]) for s in range(world)))
    torch.testing.assert_close(received.detach(), torch.cat(expected), rtol=0, atol=0)
    assert local_counts.tolist() == expected_counts

    # An arbitrary per-row function on the receiving side: the round trip must undo only the moves.
    back = combine(received * 3.0, plan, dist.group.WORLD)
    torch.testing.assert_close(back.detach(), rows.detach() * 3.0, rtol=0, atol=0)
    upstream = torch.randn(rows.shape, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)
    (back * upstream).sum().backward()
    torch.testing.assert_close(rows.grad, upstream * 3.0, rtol=0, atol=0)
    return {"received": received.shape[0]}


CASES = ("random", "skewed", "silent_rank")


def _all_cases() -> dict:
    return {case: _round_trip(case) for case in CASES}  # one launch per world size: forks are slow


@pytest.mark.parametrize("world", [2, 4])
def test_round_trip_is_exact(world):
    results = run_ranks(world, _all_cases, timeout_s=60)
    skewed = [r["skewed"]["received"] for r in results]
    # Every row went to expert 0, held by rank 0: the other ranks received nothing.
    assert skewed[0] > 0 and skewed[1:] == [0] * (world - 1)


def _input_grads_only() -> None:
    """Every row goes to the last rank's experts, so the other ranks' experts get no rows; then
    gradients are asked for the inputs only (as pipeline stages do). A rank whose expert output
    ignored its (empty) input would let autograd skip its backward all-to-alls and hang the
    others. The gradient must also equal the one computed without any communication."""
    from phalanx.model.moe import grouped_expert_ffn

    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)  # the same full expert weights on every rank
    w1, w3 = (torch.randn(N_EXPERTS, 6, DIM, generator=generator, dtype=torch.float64) for _ in range(2))
    w2 = torch.randn(N_EXPERTS, DIM, 6, generator=generator, dtype=torch.float64)
    for weight in (w1, w2, w3):
        weight.requires_grad_(True)  # as in the model: the output depends on them either way
    n_local = N_EXPERTS // world
    mine = slice(rank * n_local, (rank + 1) * n_local)
    rows = torch.randn(5, DIM, generator=torch.Generator().manual_seed(rank), dtype=torch.float64, requires_grad=True)
    counts = torch.zeros(N_EXPERTS, dtype=torch.long)
    counts[-1] = 5  # all to the last expert, held by the last rank
    received, local_counts, plan = dispatch(rows, counts, dist.group.WORLD)
    out = combine(grouped_expert_ffn(received, local_counts.tolist(), w1[mine], w2[mine], w3[mine]), plan, dist.group.WORLD)
    (grad,) = torch.autograd.grad(out.sum(), [rows])
    local = rows.detach().requires_grad_(True)
    expected_out = grouped_expert_ffn(local, counts.tolist(), w1, w2, w3)
    (expected,) = torch.autograd.grad(expected_out.sum(), [local])
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def test_input_gradients_only_with_idle_ranks():
    run_ranks(2, _input_grads_only, timeout_s=30)
