"""The slot pieces around today's dispatch give the unreplicated layer's numbers (2 and 4 ranks).

What the integration will do, in a test: each rank routes its rows (sorted by expert) to
slots (`SlotRouter`), sends them with today's `dispatch`/`combine` given the slot counts,
computes on its local slots' weights (replicas of hot experts included), and after backward
sums each expert's gradient over its replicas (`sum_replica_grads`). Compared with the same
rows through the full, unreplicated expert stack in one process:
  * outputs: every row is computed by the same expert's weights with the same arithmetic,
    only on another rank; float64 matmuls of different row batches may round differently in
    the last bit, hence rtol 1e-12;
  * gradients: each replica's summed gradient against the full stack's gradient summed over
    the ranks' rows; the same terms added in another order, rtol 1e-10 (float64).
Rows stay on their rank, stay on their node and cross nodes (declared small nodes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from phalanx.model.moe import grouped_expert_ffn
from phalanx.parallel.expert_dispatch import combine, dispatch
from phalanx.parallel.expert_slot_grads import sum_replica_grads
from phalanx.parallel.expert_slots import SlotPlacement, SlotRouter
from phalanx.testing.fork_ranks import run_ranks

N_EXPERTS, DIM, HIDDEN = 4, 5, 6
# ep=2: 3 slots per rank, one rank per node; ep=4: 2 slots per rank, nodes {0, 1} and {2, 3}.
# Replicated: experts 0 and 1 (ep=2); 0 (three times), 1 and 2 (ep=4). In the 4-rank case rank
# 2 has no replica of expert 1 on its node and spreads those rows over ranks 0 and 1.
SLOTS = {2: [0, 1, 2, 0, 3, 1], 4: [0, 1, 1, 2, 0, 3, 2, 0]}
NODE_SIZE = {2: 1, 4: 2}


def _full_weights() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    shapes = ((N_EXPERTS, HIDDEN, DIM), (N_EXPERTS, DIM, HIDDEN), (N_EXPERTS, HIDDEN, DIM))
    return [torch.randn(*shape, generator=generator, dtype=torch.float64) / DIM**0.5 for shape in shapes]


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rank's rows sorted by expert, their counts (skewed to expert 0), and an upstream gradient."""
    generator = torch.Generator().manual_seed(40 + rank)
    experts = torch.multinomial(torch.tensor([0.5, 0.25, 0.15, 0.1]), 37 + 3 * rank, replacement=True, generator=generator).sort().values
    rows = torch.randn(experts.numel(), DIM, generator=generator, dtype=torch.float64)
    upstream = torch.randn(experts.numel(), DIM, generator=generator, dtype=torch.float64)
    return rows, torch.bincount(experts, minlength=N_EXPERTS), upstream


def _slotted_layer() -> int:
    rank, ep = dist.get_rank(), dist.get_world_size()
    placement = SlotPlacement.from_slots(SLOTS[ep], N_EXPERTS, ep, node_size=NODE_SIZE[ep])
    full = _full_weights()
    held = torch.as_tensor([placement.slot_expert[s] for s in placement.local_slots(rank)])
    local = [w[held].clone().requires_grad_() for w in full]  # (local slots, ...)
    rows, counts, upstream = _rows(rank)
    rows.requires_grad_()

    # The integration's few lines: route to slots, today's dispatch on slot counts, compute, combine, unsort.
    router = SlotRouter(placement, rank, expert_load=[50.0, 25.0, 15.0, 10.0])
    _, order, slot_counts = router.route(counts, rows.shape[0])
    arrived, local_counts, plan = dispatch(rows[order], slot_counts, dist.group.WORLD)
    computed = grouped_expert_ffn(arrived, local_counts.tolist(), *local)
    out = torch.empty_like(rows).index_copy(0, order, combine(computed, plan, dist.group.WORLD))
    (out * upstream).sum().backward()
    sum_replica_grads([w.grad for w in local], placement)

    # One process, no replicas: the same rows through the full stack.
    reference_weights = [w.clone().requires_grad_() for w in full]
    reference_rows = rows.detach().clone().requires_grad_()
    reference = grouped_expert_ffn(reference_rows, counts.tolist(), *reference_weights)
    (reference * upstream).sum().backward()
    torch.testing.assert_close(out.detach(), reference.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(rows.grad, reference_rows.grad, rtol=1e-12, atol=1e-14)
    for slot_weight, reference_weight in zip(local, reference_weights):
        whole = reference_weight.grad.clone()
        dist.all_reduce(whole)  # every rank's rows: the unreplicated model's gradient
        torch.testing.assert_close(slot_weight.grad, whole[held], rtol=1e-10, atol=1e-12)
    # How many rows left this rank's node (the test checks some did).
    sent_to = torch.as_tensor(placement.rank_of_slot())[router.route(counts, rows.shape[0])[0]]
    return int((sent_to // NODE_SIZE[ep] != rank // NODE_SIZE[ep]).sum())


@pytest.mark.parametrize("world", [2, 4])
def test_slots_around_dispatch_equal_the_unreplicated_layer(world):
    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))  # its first call imports for seconds: before the fork
    crossed = run_ranks(world, _slotted_layer, timeout_s=90)
    assert sum(crossed) > 0
