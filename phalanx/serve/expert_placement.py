"""Live wide expert parallelism while serving (`--expert-slots S --rebalance-every K`,
`--expert-placement RUN_DIR`; docs/serve.md).

Every MoE layer's experts sit in S slots spread over the ep ranks (`phalanx.parallel.expert_slots`:
a hot expert may hold several slots, its rows split over them by the layer's `SlotRouter`). Rank 0
measures each step's routed rows per expert and per rank (`expert_loads.py`, summed over the dp
ranks) and feeds them to the same rebalancer training uses (`ExpertRebalancer`: a moving
average, every K-th engine step a re-plan by `phalanx balance`'s incremental solver from the
current placement, so few slots move). A placement that moves slots rides in the next step's
message (`dp_engine.DPStep`); every rank then moves its slot weights to it over the ep group
(`parallel.expert_slot_moves.move_expert_slots`: one uneven all-to-all per dtype) and rebuilds its
routers, before that step's forwards. Replicas hold identical weights and a row's output does not
depend on which replica computes it, so outputs are the same before, during and after a move.

`--expert-placement RUN_DIR`: the first placement is the balancer's for the per-expert loads the
training run recorded (its metrics.jsonl, `phalanx.balance.loads.read_load`) instead of even loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from torch import nn

from phalanx import layout_rules as rules
from phalanx.balance.loads import read_load
from phalanx.balance.rebalancer import ExpertRebalancer, initial_placement
from phalanx.balance.solve import rebalance
from phalanx.errors import UserError
from phalanx.parallel.expert import ShardedExperts, _layer_of
from phalanx.parallel.expert_slot_moves import move_expert_slots, slot_bytes
from phalanx.parallel.expert_slots import SlotPlacement, SlotRouter


@dataclass(frozen=True)
class NewPlacement:
    """What rank 0 sends every rank to install: the slot -> expert rows (MoE layers, S) and the
    load average the routers split replicated experts' rows by (None: evenly)."""
    phy2log: np.ndarray
    expert_load: np.ndarray | None


def first_placement(job, cfg, plan) -> np.ndarray | None:
    """(MoE layers, S) slot -> expert rows to start from, or None without expert slots; every
    setting checked with a one-line error (the training rules: `layout_rules`)."""
    slots, every, run = job.expert_slots, job.rebalance_every, job.expert_placement
    if not (slots or every or run):
        return None
    flag = (f"--expert-slots={slots}" if slots else f"--rebalance-every={every}" if every
            else f"--expert-placement={run}")
    slots = slots or cfg.n_experts
    problem = (rules.expert_slots_count_problem(slots, n_experts=cfg.n_experts, model=cfg.name, flag=flag)
               or rules.expert_slots_layout_problem(slots, ep=plan.ep, fsdp=False, over_tp=plan.ep_over_tp, tp=plan.tp,
                                                    pp=plan.pp, flag=flag))
    if problem:
        raise UserError(problem)
    layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.n_layers))
    if not run:
        return initial_placement(layers, cfg.n_experts, slots, plan.ep)

    load = np.asarray(read_load(run), dtype=float)
    if load.shape != (layers, cfg.n_experts):
        raise UserError(f"--expert-placement {run}: the run recorded loads of {load.shape[0]} MoE layers x "
                        f"{load.shape[1]} experts; this model has {layers} x {cfg.n_experts}")
    return rebalance(load, slots, 1, 1, plan.ep, policy="global").phy2log


def slot_placements(phy2log: np.ndarray, cfg, ep: int) -> dict[int, SlotPlacement]:
    """{layer index: SlotPlacement} for `parallelize(expert_slots=...)`."""
    layers = [layer for layer in range(cfg.n_layers) if cfg.is_moe_layer(layer)]
    return {layer: SlotPlacement.from_slots(row, cfg.n_experts, ep) for layer, row in zip(layers, phy2log)}


class LivePlacement:
    """Every rank's handle on its MoE layers' slots; on rank 0 also the rebalancer."""
    def __init__(self, model: nn.Module, phy2log: np.ndarray, n_experts: int, ep: int, every: int, planner: bool):
        """`every`: `--rebalance-every` (0: the placement stays); `planner`: this is rank 0."""
        self.modules = sorted(((_layer_of(name), module) for name, module in model.named_modules()
                               if isinstance(module, ShardedExperts) and module.placement is not None),
                              key=lambda item: item[0])
        self.n_experts, self.ep = n_experts, ep
        self.phy2log = np.array(phy2log, dtype=np.int64)  # (MoE layers, S)
        self.rebalancer = None
        if every and planner:

            weights = [self.modules[0][1].w1, self.modules[0][1].w2, self.modules[0][1].w3]
            self.rebalancer = ExpertRebalancer(self.phy2log, n_experts, ep, every=every, slot_bytes=slot_bytes(weights))
        self._pending: NewPlacement | None = None

    def observe(self, step: int, expert_tokens: np.ndarray, rank_tokens: np.ndarray):
        """Rank 0, after engine step `step`: fold in its loads (layers, experts) and (layers, ep);
        on a re-plan that moves slots, keep the new placement for the next step and return the
        event (`RebalanceEvent`: imbalance before, measured, and after, predicted)."""
        if self.rebalancer is None:
            return None
        event = self.rebalancer.observe(step, expert_tokens, rank_tokens)
        if event is None or not event.moved_slots:
            return None
        self._pending = NewPlacement(self.rebalancer.phy2log.copy(), self.rebalancer.expert_load.copy())
        return event

    def take_pending(self) -> NewPlacement | None:
        pending, self._pending = self._pending, None
        return pending

    def install(self, new: NewPlacement) -> None:
        """Every rank of the ep group together: move the slot weights and rebuild the routers."""
        for row, (_, module) in enumerate(self.modules):
            placement = SlotPlacement(tuple(int(e) for e in new.phy2log[row]), self.n_experts, self.ep,
                                      module.placement.rank_node)
            move_expert_slots([module.w1, module.w2, module.w3], None, module.placement.slot_expert,
                              placement.slot_expert, module.shard.group)
            rank = dist.get_rank(module.shard.group)
            module.placement = placement
            module.shard = dataclasses.replace(module.shard, rows=tuple(placement.slot_expert[s]
                                                                        for s in placement.local_slots(rank)))
            load = None if new.expert_load is None else new.expert_load[row]
            module.router = SlotRouter(placement, rank, load, device=module.w1.device)
        self.phy2log = np.array(new.phy2log, dtype=np.int64)
