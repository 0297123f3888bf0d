"""Expert slots and rebalancing in the training loop (`--expert-slots`, `--rebalance-every`).

The pieces (placement and routing, replica gradient sums, slot moves, the rebalancer) live in
`phalanx.parallel.expert_slots`, `expert_slot_grads`, `expert_slot_moves` and
`phalanx.balance.rebalancer`; this module is the trainer's side of them:
  * `slot_placements`: check the flags and give each MoE layer its first placement;
  * `SlotTraining.sum_replica_grads`: after the last micro-batch's backward, before clipping,
    so every replica of an expert takes the same update (the unreplicated model's math);
  * `SlotTraining.after_step`: after `optimizer.step`/`zero_grad` and `moe_stats.end_step`,
    feed the step's loads (and the ep ranks' speeds, when the job adapts) to the rebalancer; on an event, move slots (weights and AdamW
    moments) and rebuild every layer's router from the new placement and the load average.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from phalanx import layout_rules as rules
from phalanx.balance.rebalancer import ExpertRebalancer, initial_placement, loads_from_record
from phalanx.errors import UserError
from phalanx.parallel.data_parallel import uses_fsdp
from phalanx.parallel.expert import ShardedExperts, _layer_of
from phalanx.parallel.expert_slot_grads import sum_replica_param_grads
from phalanx.parallel.expert_slot_moves import move_expert_slots, slot_bytes
from phalanx.parallel.expert_slots import SlotPlacement, SlotRouter
from phalanx.parallel.mesh import weights_view


def _node_size(plan) -> int | None:
    """Ep ranks per host, for the routers' same-node preference (None: all on one host).

    ep ranks are adjacent dp ranks and, without tp or pp (which slots refuse for now), adjacent
    global ranks too, so a host holds LOCAL_WORLD_SIZE of them. Routing is correct whatever
    this says; only which replica a row prefers depends on it.
    """
    local, world = int(os.environ.get("LOCAL_WORLD_SIZE", 0)), int(os.environ.get("WORLD_SIZE", 0))
    if not local or local >= world or local >= plan.ep or plan.ep % local:
        return None
    return local


def slot_placements(cfg, model_cfg, plan) -> dict[int, SlotPlacement] | None:
    """{MoE layer index: first placement} for `--expert-slots`/`--rebalance-every`, or None when
    neither is set (today's layout). Bad settings give one-line errors."""
    if not cfg.expert_slots and not cfg.rebalance_every:
        return None

    plan = weights_view(plan)  # experts spread over dp x cp ranks
    flags = f"--expert-slots={cfg.expert_slots}" if cfg.expert_slots else f"--rebalance-every={cfg.rebalance_every}"
    experts, slots = model_cfg.n_experts, cfg.expert_slots or model_cfg.n_experts
    # The rules live in layout_rules, which the planner reads too (`phalanx plan --expert-slots`).
    if problem := (rules.expert_slots_count_problem(slots, n_experts=experts, model=model_cfg.name, flag=flags)
                   or rules.expert_slots_layout_problem(slots, ep=plan.ep, fsdp=uses_fsdp(plan),
                                                        over_tp=plan.ep_over_tp, tp=plan.tp, pp=plan.pp,
                                                        edp=plan.dp // plan.ep,
                                                        expert_shape=(model_cfg.moe_ffn_dim, model_cfg.dim),
                                                        offload=plan.offload, flag=flags)):
        raise UserError(problem)
    node_size = _node_size(plan)
    layers = [layer for layer in range(model_cfg.n_layers) if model_cfg.is_moe_layer(layer)]
    first = initial_placement(len(layers), experts, slots, plan.ep)  # (layers, S); SlotPlacement checks S
    return {layer: SlotPlacement.from_slots(row, experts, plan.ep, node_size) for layer, row in zip(layers, first)}


def slot_modules(model: nn.Module) -> list[tuple[int, ShardedExperts]]:
    """(layer index, experts) of this rank's MoE layers with slots, in layer order."""
    found = [(_layer_of(name), module) for name, module in model.named_modules()
             if isinstance(module, ShardedExperts) and module.placement is not None]
    return sorted(found, key=lambda item: item[0])


def _weights(module: ShardedExperts) -> list[nn.Parameter]:
    return [module.w1, module.w2, module.w3]


class SlotTraining:
    """The trainer's handle on every MoE layer's slots and, with `--rebalance-every`, the rebalancer."""
    def __init__(self, model: nn.Module, placements: dict[int, SlotPlacement], every: int, speed_rules=None):
        """`speed_rules`: how the ep ranks' speeds weigh re-placements (`Job.adapt_experts`)."""
        self.modules = slot_modules(model)
        self.layers = sorted(placements)  # every MoE layer of the model, also other stages'
        first = next(iter(placements.values()))
        self.ep, self.n_experts = first.ep, first.n_experts
        self.rank_node = first.rank_node
        self.rebalancer = None
        self.phy2log = np.array([placements[layer].slot_expert for layer in self.layers])  # (MoE layers, S)
        if every:
            per_slot = slot_bytes(_weights(self.modules[0][1])) * 3 if self.modules else 0  # weights + AdamW's two moments (fp32)
            self.rebalancer = ExpertRebalancer(self.phy2log, self.n_experts, self.ep, every=every, slot_bytes=per_slot,
                                               speed_rules=speed_rules)

    def sum_replica_grads(self) -> None:
        """Every replica's gradient := the sum over its expert's replicas (all ep ranks call this)."""
        for _, module in self.modules:
            sum_replica_param_grads(_weights(module), module.placement, module.shard.group)

    def after_step(self, step: int, moe_record: dict, optimizer: torch.optim.Optimizer,
                   speeds: list[float] | None = None) -> dict | None:
        """Feed the step's loads (and, when measured, each ep rank's speed: `expert_speeds.py`)
        to the rebalancer; on an event move the slots and return its row."""
        if self.rebalancer is None or not moe_record:
            return None
        event = self.rebalancer.observe(step, *loads_from_record(moe_record, self.ep), speeds=speeds)
        if event is None:
            return None
        self.apply_placement(self.rebalancer.phy2log, optimizer, move=True)
        return event.row()

    def apply_placement(self, phy2log, optimizer, *, move: bool) -> None:
        """Install the placement `phy2log` (MoE layers, S): move weights and optimizer state there
        when `move`, and rebuild each layer's router from it and the load average."""
        loads = self.rebalancer.expert_load if self.rebalancer is not None else None
        self.phy2log = np.array(phy2log, dtype=np.int64)
        for layer, module in self.modules:
            row = self.layers.index(layer)
            new = SlotPlacement(tuple(int(e) for e in phy2log[row]), self.n_experts, self.ep, self.rank_node)
            if move:
                move_expert_slots(_weights(module), optimizer, module.placement.slot_expert, new.slot_expert,
                                  module.shard.group)
            rank = dist.get_rank(module.shard.group)
            module.placement = new
            module.shard = dataclasses.replace(module.shard, rows=tuple(new.slot_expert[s] for s in new.local_slots(rank)))
            module.router = SlotRouter(new, rank, None if loads is None else loads[row], device=module.w1.device)

    def state_dict(self) -> dict:
        """What a checkpoint's phalanx.json keeps (`expert_slots`): the placement, and with
        rebalancing the load averages, so a resumed run routes and re-plans as this one would."""
        if self.rebalancer is not None:
            return self.rebalancer.state_dict()
        return {"phy2log": self.phy2log.tolist()}

    def load_state(self, state: dict | None) -> bool:
        """Install a checkpoint's placement (before its weights load: the checkpoint holds experts
        in expert order, and each rank then takes the rows of its slots). A checkpoint of another
        layout (no slots, another S or ep) keeps this run's first placement; returns whether
        the saved placement was taken."""
        if not state or np.shape(state.get("phy2log")) != self.phy2log.shape:
            return False
        if self.rebalancer is not None and "expert_load" in state:
            self.rebalancer.load_state_dict(state)
        self.apply_placement(np.array(state["phy2log"], dtype=np.int64), None, move=False)
        return True
