"""Routed rows per rank of each MoE layer, per engine step, for /metrics
(`phalanx_expert_imbalance`, `phalanx_expert_rows_total`).

A forward pre-hook on every layer's experts module reads the count of rows routed to each
expert (the `counts` argument of `GroupedExperts.forward`); experts are spread over the ranks of
the expert-parallel group in contiguous blocks (`phalanx.parallel.expert`), so a rank's rows are
the sum over its block. In one process there is one rank.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.model.moe import GroupedExperts


class ExpertLoads:
    def __init__(self, model: nn.Module, ranks: int = 1):
        self.ranks = ranks
        self._step: dict[int, torch.Tensor] = {}  # id(experts module) -> rows per expert this step
        self._handles = [module.register_forward_pre_hook(self._seen) for module in model.modules()
                         if isinstance(module, GroupedExperts)]

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def _seen(self, module, args) -> None:
        counts = args[1].detach()  # (experts,) rows per expert of this forward (a step may run two)
        self._step[id(module)] = counts if id(module) not in self._step else self._step[id(module)] + counts

    def take(self) -> list[list[int]] | None:
        """This step's rows per rank of each MoE layer (layers, ranks), and start the next step."""
        if not self._step:
            return None
        counts = torch.stack(list(self._step.values())).cpu()  # (layers, experts), in layer order
        self._step = {}
        per_rank = counts.reshape(counts.shape[0], self.ranks, -1).sum(-1)  # (layers, ranks)
        return per_rank.tolist()
