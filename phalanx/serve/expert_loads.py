"""Routed rows per expert and per rank of each MoE layer, per engine step: for /metrics
(`phalanx_expert_imbalance`, `phalanx_expert_rows_total`) and for live rebalancing
(`--rebalance-every`, `serve/expert_placement.py`).

A forward pre-hook on every layer's experts module reads the count of rows routed to each
expert (the `counts` argument of `GroupedExperts.forward`): the rows of this rank's own tokens,
which under expert parallelism are then sent to the ranks holding their experts. Without expert
slots an expert's rows go to the rank holding its contiguous block (`phalanx.parallel.expert`);
with slots the layer's `SlotRouter` splits them over the expert's replicas, and the slot counts
it returns say which rank gets how many. In one process (or under plain tp) there is one rank.

Under attention data parallelism each dp rank counts its own tokens; rank 0 sums the counts of
all ranks (`dp_engine.py`). Under ep_over_tp every tp rank sees the same (replicated) rows, so
one rank's counts are the whole layer's.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from phalanx.model.moe import GroupedExperts


class ExpertLoads:
    def __init__(self, model: nn.Module, ranks: int = 1):
        self.ranks = ranks
        self._experts: dict[int, torch.Tensor] = {}  # id(experts module) -> rows per expert this step
        self._ranks: dict[int, torch.Tensor] = {}  # id(experts module) -> rows per destination rank
        self._ignore = False
        self._handles = [module.register_forward_pre_hook(self._seen) for module in model.modules()
                         if isinstance(module, GroupedExperts)]

    @property
    def active(self) -> bool:
        return bool(self._handles)

    @contextmanager
    def ignored(self):
        """Forwards that are not traffic (the filler forward of a rank with nothing to run)."""
        self._ignore = True
        try:
            yield
        finally:
            self._ignore = False

    def _seen(self, module, args) -> None:
        if self._ignore:
            return
        counts = args[1].detach()  # (experts,) rows per expert of this forward (a step may run two)
        router = getattr(module, "router", None)
        if router is not None:  # (slots,) -> (ranks, slots per rank): the replicas' ranks
            per_rank = router.route(counts, args[0].shape[0])[2].reshape(self.ranks, -1).sum(-1)
        else:
            per_rank = counts.reshape(self.ranks, -1).sum(-1)  # (ranks,): contiguous blocks of experts
        key = id(module)
        self._experts[key] = counts if key not in self._experts else self._experts[key] + counts
        self._ranks[key] = per_rank if key not in self._ranks else self._ranks[key] + per_rank

    def take_counts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Since the last call: rows per expert (layers, experts) and per rank (layers, ranks),
        MoE layers in layer order, on the CPU; None when nothing was routed."""
        if not self._experts:
            return None
        experts = torch.stack(list(self._experts.values())).cpu()  # (layers, experts)
        ranks = torch.stack(list(self._ranks.values())).cpu()  # (layers, ranks)
        self._experts, self._ranks = {}, {}
        return experts, ranks

    def take(self) -> list[list[int]] | None:
        """This step's rows per rank of each MoE layer (layers, ranks), and start the next step."""
        counts = self.take_counts()
        return None if counts is None else counts[1].tolist()
