"""Expert parallelism: each rank of an "ep" group holds n_experts / ep experts; tokens travel.

Where the ranks come from. ep is carved out of the data-parallel ranks (as in Megatron-Core
and torchtitan): the dp axis is split into ("edp", "ep") with ep ranks adjacent, by
`ParallelMesh.split_dp`. Within an ep group every rank reads its own data slice, routes its own
tokens, sends each assignment to the rank that holds its expert, and gets the results back.
Rank i of the group holds experts [i * n_local, (i + 1) * n_local), the same rows of the full
stacked weights that one process would hold (see `phalanx.model.init`).

How gradients are reduced (the rule). A loss L = mean over dp ranks of each rank's loss, so
every weight's gradient is (1 / dp) * sum over all dp ranks of that rank's contribution.
  * Non-expert weights live on every dp rank: DDP or FSDP over "dp" averages them, as usual.
  * Expert weights of ep coordinate i live on the dp / ep ranks that share i (the "edp" group).
    Through the all-to-all backward, a rank's expert gradient already sums the contributions
    of every token of its ep group; summing it over "edp" adds the other ep groups. Dividing by
    dp (not by edp) turns that sum into the mean over the whole dp batch.
  With DDP, expert weights are excluded from DDP's reduction and reduced by a gradient hook
  over "edp"; with FSDP, the experts are sharded over "edp" and reduced with divide factor dp.

Dispatch and combine are `all_to_all_single` with uneven splits, after a first all-to-all of
the per-expert counts so each rank knows how many rows it will receive. Both are autograd
functions whose backward is the reverse all-to-all, so gradients flow back to the senders.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from phalanx import layout_rules as rules
from phalanx.errors import UserError
from phalanx.model.config import ModelConfig
from phalanx.model.moe import GroupedExperts, in_recompute
from phalanx.parallel.data_parallel import fsdp_options, uses_fsdp
from phalanx.parallel.mesh import ParallelMesh
from phalanx.plan import Plan


class _AllToAll(torch.autograd.Function):
    """Rows of x go to ranks by `send` splits, arrive by `recv` splits; backward reverses it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_in = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(
            grad_in, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group
        )
        return grad_in, None, None, None


@dataclass
class DispatchPlan:
    """What combine needs to send results back where their rows came from."""

    send: list[int]
    """Rows this rank sent to each ep rank."""
    recv: list[int]
    """Rows this rank received from each ep rank."""
    regroup: torch.Tensor
    """(received rows,) positions in arrival order (by source rank), listed by local expert."""


def _expert_major(recv_counts: torch.Tensor) -> torch.Tensor:
    """Row positions that reorder arrivals from (source rank, expert) to (expert, source rank).

    recv_counts: (ep, n_local) rows from each source rank for each local expert; arrivals are
    laid out source-major, each source's rows already sorted by expert.
    """
    counts = recv_counts.reshape(-1)  # (ep * n_local,) in arrival order
    starts = torch.cumsum(counts, 0) - counts  # first arrival position of each block
    blocks = torch.arange(counts.numel(), device=counts.device).view(recv_counts.shape).t().reshape(-1)
    lengths, block_starts = counts[blocks], starts[blocks]  # in expert-major order
    total = int(counts.sum())
    offset_in_block = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths, output_size=total
    )
    return torch.repeat_interleave(block_starts, lengths, output_size=total) + offset_in_block


def dispatch(rows: torch.Tensor, counts: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Send rows (sorted by global expert, counts per expert) to the ranks holding the experts.

    Returns the rows this rank's experts must process, sorted by local expert, the count per
    local expert, and the plan that `combine` uses to return the results.
    """
    ep = dist.get_world_size(group)
    n_local = counts.numel() // ep
    # First the counts: recv_counts[s, e] = rows rank s will send for my local expert e.
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts.contiguous(), group=group)
    recv_counts = recv_counts.view(ep, n_local)  # (source rank, local expert)
    send = counts.view(ep, n_local).sum(dim=1).tolist()
    recv = recv_counts.sum(dim=1).tolist()
    arrived = _AllToAll.apply(rows, send, recv, group)  # (received, dim), source-major
    regroup = _expert_major(recv_counts)
    return arrived[regroup], recv_counts.sum(dim=0), DispatchPlan(send=send, recv=recv, regroup=regroup)


def combine(out: torch.Tensor, plan: DispatchPlan, group) -> torch.Tensor:
    """Inverse of `dispatch`: results go back to their senders, in the order they were sent."""
    arrival_order = torch.empty_like(out).index_copy(0, plan.regroup, out)  # undo the regroup
    return _AllToAll.apply(arrival_order, plan.recv, plan.send, group)


class _ExpertParallelHooks:
    """Forward pre/post hooks that wrap one GroupedExperts call in dispatch and combine."""

    def __init__(self, group):
        self.group = group
        self.pending: list[DispatchPlan] = []

    def before(self, module: nn.Module, args):
        rows, counts = args
        local_rows, local_counts, plan = dispatch(rows, counts, self.group)
        self.pending.append(plan)
        if module.training and not in_recompute():
            module.received_tokens = getattr(module, "received_tokens", 0) + local_rows.shape[0]
        return local_rows, local_counts

    def after(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return combine(output, self.pending.pop(), self.group)


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


def validate_ep(cfg: ModelConfig, plan: Plan) -> None:
    """The model-dependent rules for ep (layout_rules; Plan.validate checks that ep divides dp)."""
    if problem := rules.ep_problem(plan.ep, dp=plan.dp, n_experts=cfg.n_experts, model=cfg.name):
        raise UserError(f"invalid plan: {problem}")


def shard_experts(experts: GroupedExperts, group, ep_rank: int, ep: int) -> GroupedExperts:
    """Keep rank ep_rank's block of `experts` (meta or real weights) and route over `group`.

    Rows [ep_rank * n_local, (ep_rank + 1) * n_local) of each stacked weight stay; forward then
    takes rows for all experts, dispatches them to their owners and returns the combined rows.
    """
    n_experts = experts.w1.shape[0]
    n_local = n_experts // ep
    start, stop = ep_rank * n_local, (ep_rank + 1) * n_local
    for weight in ("w1", "w2", "w3"):
        full = getattr(experts, weight)
        setattr(experts, weight, nn.Parameter(full.detach()[start:stop].clone()))  # (n_local, ...)
    experts.expert_shard = (start, stop, n_experts)
    experts.ep_group = group
    hooks = _ExpertParallelHooks(group)
    experts.register_forward_pre_hook(hooks.before)
    experts.register_forward_hook(hooks.after)
    return experts


def apply_ep(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    """Keep this rank's experts in every MoE layer and route their tokens over "ep" (meta model)."""
    plan = mesh.plan
    if plan.ep == 1:
        return model
    cfg = model.cfg
    validate_ep(cfg, plan)
    ep_mesh = mesh.split_dp("edp", "ep", plan.ep)
    ep_group, ep_rank = ep_mesh["ep"].get_group(), ep_mesh.get_local_rank("ep")
    edp = plan.dp // plan.ep
    ignored = []
    for name, experts in model.named_modules():
        if not isinstance(experts, GroupedExperts):
            continue
        shard_experts(experts, ep_group, ep_rank, plan.ep)
        experts.ep_mesh = ep_mesh["ep"]  # checkpoints save the experts as DTensors over it
        ignored += [f"{name}.{weight}" for weight in ("w1", "w2", "w3")]
        if uses_fsdp(plan):
            from torch.distributed.fsdp import fully_shard

            # Before the blocks are wrapped over "dp" (apply_fsdp), so those skip the experts.
            # Zero level, precision and offload follow apply_fsdp (`fsdp_options`): in
            # particular no resharding after forward under pp, where the zero-bubble schedules
            # (zbv, dualpipev) find the weights for their separate weight-gradient pass among
            # the module's registered parameters: resharded experts were not found there, and
            # their gradients came out wrong or missing.
            fully_shard(experts, mesh=ep_mesh["edp"], **fsdp_options(plan, mesh.device))
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


def expert_params(model: nn.Module):
    """(ids of this rank's expert-parallel parameters, ep group) for gradient clipping, or
    None when the model has no expert parallelism."""
    ids, group = set(), None
    for module in model.modules():
        if getattr(module, "expert_shard", None) is not None:
            group = module.ep_group
            ids |= {id(param) for param in module.parameters(recurse=False)}
    return (ids, group) if group is not None else None


def gather_experts(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (canonical names, full over dp/fsdp) with each expert stack gathered over "ep".

    Every rank of the ep group must call this together (tests and weight comparisons).
    """
    from phalanx.model.init import canonical_name

    for name, module in model.named_modules():
        if getattr(module, "expert_shard", None) is None:
            continue
        for weight in ("w1", "w2", "w3"):
            key = canonical_name(f"{name}.{weight}")
            local = state[key].contiguous()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(module.ep_group))]
            dist.all_gather(parts, local, group=module.ep_group)
            state[key] = torch.cat(parts)  # (n_experts, ...)
    return state
