"""DeepSeek EPLB's entry point, `rebalance_experts`, on phalanx's placement.

Same arguments and results as the reference (torch tensors in and out), so code written for it
can switch by changing an import; what differs is the placement itself: no GPU holds two
replicas of one expert, and refinement runs unless `refine=False` (with it off, the result is
the reference's wherever the reference puts no two replicas on one GPU). `log2phy` lists each
expert's slots in increasing order.
"""

from __future__ import annotations

import torch

from phalanx.balance.solve import rebalance


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                      *, refine: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phy2log (layers, num_replicas), log2phy (layers, experts, most replicas), logcnt (layers, experts)), int64.

    `weight` (layers, experts): the load of each logical expert. The policy is hierarchical
    when num_groups is a multiple of num_nodes, else global, as in the reference. The results
    are on `weight`'s device.
    """
    result = rebalance(weight.detach().float().cpu().numpy(), num_replicas, num_groups, num_nodes, num_gpus, refine=refine)
    as_tensor = lambda array: torch.from_numpy(array).to(torch.int64).to(weight.device)  # noqa: E731
    return as_tensor(result.phy2log), as_tensor(result.log2phy()), as_tensor(result.logcnt)
