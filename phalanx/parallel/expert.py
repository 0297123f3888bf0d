"""Expert parallelism: each rank of an "ep" group holds n_experts / ep experts; tokens travel.

Where the ranks come from. ep is carved out of the data-parallel ranks (as in Megatron-Core
and torchtitan): the dp axis is split into ("edp", "ep") with ep ranks adjacent, by
`ParallelMesh.split_dp`. Within an ep group every rank reads its own data slice, routes its own
tokens, sends each assignment to the rank that holds its expert, and gets the results back.
Rank i of the group holds experts [i * n_local, (i + 1) * n_local), the same rows of the full
stacked weights that one process would hold (see `phalanx.parallel.materialize`).

How gradients are reduced (the rule). A loss L = mean over dp ranks of each rank's loss, so
every weight's gradient is (1 / dp) * sum over all dp ranks of that rank's contribution.
  * Non-expert weights live on every dp rank: DDP or FSDP over "dp" averages them, as usual.
  * Expert weights of ep coordinate i live on the dp / ep ranks that share i (the "edp" group).
    Through the all-to-all backward, a rank's expert gradient already sums the contributions
    of every token of its ep group; summing it over "edp" adds the other ep groups. Dividing by
    dp (not by edp) turns that sum into the mean over the whole dp batch.
  With DDP, expert weights are excluded from DDP's reduction and reduced by a gradient hook
  over "edp"; with FSDP, the experts are sharded over "edp" and reduced with divide factor dp
  (on dim 0, or with expert slots inside each slot: `_within_slots`).

With ep_over_tp=true the ep group is drawn from the dp x tp ranks instead, each tp rank sending
1/tp of the (tp-replicated) rows; edp is then dp x tp / ep and the rule is unchanged
(`phalanx.parallel.expert_fold`).

Each MoE layer's `GroupedExperts` is replaced by a `ShardedExperts`: declared fields say which
experts it holds and over which group (`ExpertShard`), and its forward wraps the experts in
dispatch and combine (`phalanx.parallel.expert_dispatch`). Materialization reads the shard to
fill each rank's block (`phalanx.parallel.materialize`); the model itself knows no mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from phalanx.errors import UserError
from phalanx.model.init import canonical_name
from phalanx.model.moe import GroupedExperts, grouped_expert_ffn, prefer_block_loop
from phalanx.parallel.data_parallel import fsdp_options, uses_fsdp
from phalanx.parallel.expert_dispatch import combine, plan_dispatch, regroup_by_expert, return_rows, send_rows
from phalanx.parallel.expert_fold import TpFold, gather_from_tp, scatter_to_tp
from phalanx.parallel.mesh import ParallelMesh
from phalanx.plan_model_checks import validate_ep  # noqa: F401 (the rule's home; imported from here too)


@dataclass(frozen=True)
class ExpertShard:
    """Which experts one ep rank holds, and over which group their tokens travel."""
    start: int
    stop: int
    """This rank keeps experts [start, stop) of the full stack."""
    n_experts: int
    group: Any
    """The ep process group that dispatch and combine run over."""
    mesh: Any = None
    """The 1-D "ep" DeviceMesh: checkpoints save the experts as DTensors sharded over it."""
    fold: TpFold | None = None
    """With ep_over_tp: the tp group whose ranks each send 1/tp of the rows (expert_fold.py)."""
    rows: tuple[int, ...] | None = None
    """With expert slots (`--expert-slots`): the expert of each local slot, the rows of the full
    stack this rank keeps (start/stop then number slots, not experts). None: [start, stop)."""
    def expert_rows(self) -> list[int]:
        """The full stack's rows this rank holds, in local order."""
        return list(self.rows) if self.rows is not None else list(range(self.start, self.stop))


class ShardedExperts(GroupedExperts):
    """One ep rank's block of the stacked experts. forward takes rows for all experts (sorted
    by expert, as `MoE` sends them), dispatches them to their owners, runs this rank's experts
    on what arrives and sends the results back: to `MoE` it is a `GroupedExperts`."""
    def __init__(self, full: GroupedExperts, shard: ExpertShard):
        rows, hidden, dim = shard.expert_rows(), full.w1.shape[1], full.w1.shape[2]
        with torch.device("meta"):  # placeholders, replaced by the block of the full weights
            super().__init__(len(rows), dim, hidden)
        for weight in ("w1", "w2", "w3"):
            block = getattr(full, weight).detach()[rows].clone()  # (n_local, ...)
            setattr(self, weight, nn.Parameter(block))
        self.shard: ExpertShard = shard
        self.placement = None
        """With expert slots: this layer's `SlotPlacement`, and `router` its `SlotRouter` on this
        rank (both replaced at each rebalance, `phalanx.train.expert_slot_training`)."""
        self.router = None

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows: (n, dim) sorted by global expert; counts: (n_experts,) -> (n, dim)."""
        fold, n = self.shard.fold, rows.shape[0]
        if fold is not None:  # the rows are the same on every tp rank: each sends its slice
            rows, counts = scatter_to_tp(rows, counts, fold)
        if self.router is None:
            out = self._exchange(rows, counts)
        else:
            # Expert slots: each row picks a replica slot of its expert (no collective), and
            # slots take the place of experts in dispatch (docs/expert_slots.md).
            _, order, slot_counts = self.router.route(counts, rows.shape[0])
            combined = self._exchange(rows[order], slot_counts)
            out = combined.new_empty(combined.shape).index_copy(0, order, combined)
        return gather_from_tp(out, n, fold) if fold is not None else out

    def _exchange(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert (or slot) to their owners, this rank's experts on what
        arrives, the results back: (n, dim) -> (n, dim)."""
        group = self.shard.group
        plan = plan_dispatch(counts, group)
        arrived = send_rows(rows, plan, group)  # (received, dim) in (source rank, local expert) blocks
        if prefer_block_loop(arrived, self.w1.shape[0], len(plan.block_counts)):
            # The loop runs each block where it lies: no regroup by expert and back.
            self.count_received(arrived)
            out = grouped_expert_ffn(arrived, plan.block_counts, self.w1, self.w2, self.w3, experts=plan.block_experts,
                                     **self.loop_products(arrived))
            return return_rows(out, plan, group)
        by_expert, local_counts = regroup_by_expert(arrived, plan)
        return combine(self.compute(by_expert, local_counts, plan.local_counts), plan, group)


def _within_slots(edp: int):
    """FSDP2's placement for a slot stack (slots, a, b): sharded over edp inside each slot, on
    dim 1 or else dim 2 (the first that edp divides evenly, as FSDP2 needs off dim 0), never on
    dim 0. So every edp rank holds every local slot, and all ranks of an ep group (one edp
    coordinate) hold the same slice of each: the replica sum, the slot moves and the
    rebalancing run on the local shards as they do on whole slots under DDP, with no gather
    (docs/expert_slots.md). The rule that one of the dims divides is
    `layout_rules.expert_slots_layout_problem`'s."""
    def placement(param: nn.Parameter) -> Shard:
        for dim in (1, 2):
            if param.shape[dim] % edp == 0:
                return Shard(dim)
        raise UserError(f"expert slots under FSDP: edp={edp} divides neither dim 1 nor dim 2 of {tuple(param.shape)}")

    return placement


class _ReduceOverEdp:
    """Gradient hook for DDP layouts: sum an expert gradient over "edp", divide by dp."""
    def __init__(self, group, edp: int, dp: int):
        self.group, self.edp, self.dp = group, edp, dp

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        if self.edp > 1:
            dist.all_reduce(grad, group=self.group)
        return grad / self.dp


def _hook_gradients_each_forward(reduce: _ReduceOverEdp):
    """A pre-forward hook that attaches `reduce` to the module's current weights.

    Attached at forward time rather than once, because materialization (`to_empty`) replaces
    the meta parameters by new ones, which would drop hooks registered before it.
    """
    hooked: dict[str, int] = {}

    def attach(module: nn.Module, args) -> None:
        for name, param in module.named_parameters(recurse=False):
            if hooked.get(name) != id(param):
                param.register_hook(reduce)
                hooked[name] = id(param)

    return attach


def shard_experts(experts: GroupedExperts, group, ep_rank: int, ep: int, mesh=None,
                  fold: TpFold | None = None, placement=None) -> ShardedExperts:
    """Rank ep_rank's block of `experts` (meta or real weights), routing over `group`: rows
    [ep_rank * n_local, (ep_rank + 1) * n_local) of each stacked weight, or with a
    `SlotPlacement` the rows of its local slots' experts. The caller puts the result in place
    of `experts`."""
    n_experts = experts.w1.shape[0]
    if placement is None:
        n_local = n_experts // ep
        shard = ExpertShard(start=ep_rank * n_local, stop=(ep_rank + 1) * n_local, n_experts=n_experts,
                            group=group, mesh=mesh, fold=fold)
        return ShardedExperts(experts, shard)
    slots = placement.local_slots(ep_rank)
    rows = tuple(placement.slot_expert[slot] for slot in slots)
    shard = ExpertShard(start=slots.start, stop=slots.stop, n_experts=n_experts, group=group, mesh=mesh, fold=fold,
                        rows=rows)
    return ShardedExperts(experts, shard)


def apply_ep(model: nn.Module, mesh: ParallelMesh, slots: dict | None = None) -> nn.Module:
    """Keep this rank's experts in every MoE layer and route their tokens over "ep" (meta model).

    slots: with `--expert-slots`, {layer index: SlotPlacement} (`phalanx.train.expert_slot_training`).
    """
    plan = mesh.plan
    if plan.ep == 1:
        return model
    cfg = model.cfg
    validate_ep(cfg, plan)
    fold = None
    if plan.ep_over_tp:  # MoE parallel folding: ep groups drawn from dp x tp (expert_fold.py)
        ep_mesh = mesh.fold_dp_tp("edp", "ep", plan.ep)
        fold = TpFold(mesh.group("tp"), mesh.axis_rank("tp"), plan.tp)
    else:
        ep_mesh = mesh.split_dp("edp", "ep", plan.ep)
    ep_group, ep_rank = ep_mesh["ep"].get_group(), ep_mesh.get_local_rank("ep")
    edp = plan.dp * (plan.tp if plan.ep_over_tp else 1) // plan.ep
    ignored = []
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, GroupedExperts)]
    for name, full in found:
        placement = (slots or {}).get(_layer_of(name))
        experts = shard_experts(full, ep_group, ep_rank, plan.ep, mesh=ep_mesh["ep"], fold=fold, placement=placement)
        if placement is not None:
            # Imported when run, not at the top: it brings in numpy, which start-up need not wait for.
            from phalanx.parallel.expert_slots import SlotRouter

            experts.placement, experts.router = placement, SlotRouter(placement, ep_rank, device=mesh.device)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, experts)
        ignored += [f"{name}.{weight}" for weight in ("w1", "w2", "w3")]
        if uses_fsdp(plan):

            # Before the blocks are wrapped over "dp" (apply_fsdp), so those skip the experts.
            # Zero level, precision and offload follow apply_fsdp (`fsdp_options`): in
            # particular no resharding after forward under pp, where the zero-bubble schedules
            # (zbv, dualpipev) find the weights for their separate weight-gradient pass among
            # the module's registered parameters: resharded experts were not found there, and
            # their gradients came out wrong or missing.
            fully_shard(experts, mesh=ep_mesh["edp"], **fsdp_options(plan, mesh.device),
                        shard_placement_fn=None if placement is None else _within_slots(edp))
            experts.set_gradient_divide_factor(float(plan.dp))
            if mesh.device.type != "cuda" and edp > 1:
                # A divide factor other than the group size is a PREMUL_SUM reduction, which
                # gloo lacks: sum, then divide, instead. Not when edp == 1: there torch 2.13
                # skips the collective but would then divide twice (once per path).
                experts.set_force_sum_reduction_for_comms(True)
        else:
            reduce = _ReduceOverEdp(ep_mesh["edp"].get_group() if edp > 1 else None, edp, plan.dp)
            experts.register_forward_pre_hook(_hook_gradients_each_forward(reduce))
    if not uses_fsdp(plan):
        # DDP must neither broadcast nor average expert weights over dp: they differ per ep rank.
        model._ddp_params_and_buffers_to_ignore = ignored
    return model


def _layer_of(name: str) -> int:
    """The transformer layer index of a module name (layers.<i>.feed_forward.experts)."""
    return int(canonical_name(name).split(".")[1])


def expert_params(model: nn.Module):
    """(ids of this rank's expert-parallel parameters, ep group, {id: slot mask}) for gradient
    clipping, or None when the model has no expert parallelism. The masks (expert slots with
    replicas only) keep each expert's first slot: after the replica sum every replica holds the
    expert's whole gradient, which the norm must count once."""
    # Imported when run, not at the top: it brings in numpy, which start-up need not wait for.
    from phalanx.parallel.expert_slot_grads import counted_once

    ids, group, once = set(), None, {}
    for module in model.modules():
        if isinstance(module, ShardedExperts):
            group = module.shard.group
            ids |= {id(param) for param in module.parameters(recurse=False)}
            if module.placement is not None and module.placement.replicas().max() > 1:
                mask = counted_once(module.placement, dist.get_rank(group))
                for param in module.parameters(recurse=False):
                    once[id(param)] = torch.as_tensor(mask, device=param.device)
    return (ids, group, once) if group is not None else None


def gather_experts(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (canonical names, full over dp/fsdp) with each expert stack gathered over "ep".

    Every rank of the ep group must call this together (tests and weight comparisons).
    """
    for name, module in model.named_modules():
        if not isinstance(module, ShardedExperts):
            continue
        for weight in ("w1", "w2", "w3"):
            key = canonical_name(f"{name}.{weight}")
            local = state[key].contiguous()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(module.shard.group))]
            dist.all_gather(parts, local, group=module.shard.group)
            state[key] = torch.cat(parts)  # (n_experts, ...), or with slots (S, ...)
            if module.placement is not None:  # slots -> experts: each expert's first slot
                state[key] = state[key][[module.placement.slot_expert.index(e) for e in range(module.shard.n_experts)]]
    return state
