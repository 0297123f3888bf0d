"""Mixture-of-experts feed-forward for one device: router, grouped experts, combine.

Expert weights are stacked into (n_experts, ...) tensors held by `GroupedExperts`, so that
expert parallelism can keep a contiguous block of experts per rank, and tokens are processed
grouped by expert (sorted, then one contiguous slice per expert) rather than masked or padded:
one `torch._grouped_mm` per weight where that kernel works (checked once per device and
dtype), otherwise one matmul per expert.

`GroupedExperts.forward(rows, counts)` is the seam that expert parallelism uses: it receives the
rows sorted by expert and the count per expert, and `phalanx.parallel.expert.ShardedExperts`
overrides it to dispatch the rows to the ranks holding their experts, `compute` there, and
combine. Nothing in this file knows about ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.model.config import ModelConfig
from phalanx.model.feed_forward import FeedForward
from phalanx.model.router import Router, count_per_expert


class ExpertCopies(Protocol):
    """Copies of the experts' weights in a layout some kernel reads faster, kept from outside
    the model (oneDNN's blocked copies for inference on CPU: `phalanx.cpu_ops.onednn_linear`)."""

    def ffn(self, rows: torch.Tensor, expert: int, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
        """SwiGLU of `rows` with expert `expert`'s weights, read from the copies."""


def grouped_expert_ffn(
    x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
    experts: list[int] | None = None, linear: Callable = F.linear, blocked: ExpertCopies | None = None,
) -> torch.Tensor:
    """SwiGLU of each contiguous group of rows of x with its own expert's weights.

    x: (rows, dim) in contiguous groups; counts[g] rows belong to group g, computed by expert
    experts[g] (default: group g is expert g, i.e. x sorted by expert; an expert may own
    several groups, as the (source rank, expert) blocks of expert parallelism's arrivals do);
    w1, w3: (experts, hidden, dim); w2: (experts, dim, hidden). `linear`: the product
    `F.linear(rows, weight)`, or oneDNN's for inference on CPU (`cpu_ops/onednn_linear.py`);
    `blocked`: copies of these weights that then run each expert (oneDNN's blocked copies for
    inference on CPU).

    One matmul per expert per weight over exactly that expert's rows: no padding, so the cost
    follows the number of rows, however skewed the routing. The fallback of
    `grouped_mm_expert_ffn` (and the reference it is checked against): it needs the counts on
    the host, and a Python loop over the local experts.
    """
    outputs = []
    # unbind, not w1[expert]: indexing one expert's slice has a backward that materializes a
    # zero gradient of the whole stack per expert and adds them up; unbind's backward stacks
    # the per-expert gradients once (benchmarks/expert_arrival_blocks.py: 32 experts of ~256
    # rows, forward + backward, 82-85 ms with slices against 63 ms).
    per_expert = list(zip(w1.unbind(0), w2.unbind(0), w3.unbind(0))) if blocked is None else []
    for group, rows in enumerate(torch.split(x, counts)):
        if rows.shape[0] == 0:
            continue
        expert = group if experts is None else experts[group]
        if blocked is not None:
            outputs.append(blocked.ffn(rows, expert, w1, w2, w3))
            continue
        e1, e2, e3 = per_expert[expert]
        hidden = F.silu(linear(rows, e1)) * linear(rows, e3)  # (rows, hidden)
        outputs.append(linear(hidden, e2))  # (rows, dim)
    if not outputs:
        # No rows at all (a rank that received nothing): still depend on x and the weights, so
        # every rank produces (zero) gradients and runs the same backward collectives, even
        # when autograd is asked for input gradients only (pipeline stages do that) and would
        # otherwise prune the path through an output that ignores x.
        return x * 0 + 0 * (w1.sum() + w2.sum() + w3.sum())
    return torch.cat(outputs)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's matmuls run in: autocast's where it is on for x's device, else x's own."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def grouped_mm_expert_ffn(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """The same SwiGLU as `grouped_expert_ffn`, one `torch._grouped_mm` per weight.

    Each call multiplies every expert's contiguous group of rows by that expert's weight in
    one kernel; the groups end at `offsets`, so there is no loop over experts, no padding, and
    no host sync on the counts. Under autocast the operands are cast to its dtype, as autocast
    does for the matmuls of the loop (whether `_grouped_mm` is on autocast's list is not
    assumed). The gradient arriving at the output must be a plain tensor (torch 2.13's CPU
    kernel rejects an expanded one); in `MoE.forward` it comes through the multiply by the
    combine weights (`WeightedCombine`), which always makes one.
    """
    dtype = compute_dtype(x)
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    offsets = torch.cumsum(counts, 0).to(torch.int32)  # (experts,) end row of each expert's group
    hidden = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)) * torch._grouped_mm(
        x, w3.transpose(-2, -1), offs=offsets
    )  # (rows, hidden)
    return torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets)  # (rows, dim)


_GROUPED_MM_CHECKED: dict[tuple, bool] = {}


def grouped_mm_works(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether `grouped_mm_expert_ffn` runs here and agrees with the loop, forward and backward.

    `torch._grouped_mm` is private, absent from older torch, and its kernels differ by device,
    dtype and torch version (torch 2.13's CPU kernel, for one, rejects an expanded output
    gradient). So it is tried once per (device, dtype, dim, hidden) on a small problem with
    uneven groups and an empty one, against the loop, and used only if that succeeds; any
    error or disagreement means the loop. Uses its own random generator: the training's random
    state is untouched.
    """
    dtype = compute_dtype(x)
    key = (x.device, dtype, w1.shape[-1], w1.shape[-2])
    if key not in _GROUPED_MM_CHECKED:
        _GROUPED_MM_CHECKED[key] = hasattr(torch, "_grouped_mm") and _agrees_with_loop(x.device, dtype, *key[2:])
    return _GROUPED_MM_CHECKED[key]


def _agrees_with_loop(device: torch.device, dtype: torch.dtype, dim: int, hidden: int) -> bool:
    # Pass-through saved-tensor hooks: the check runs inside the first forward, possibly in an
    # activation-checkpointed block, whose hooks must not see its tensors (the recomputation,
    # which finds the answer cached, would save fewer and fail). inference_mode(False): should
    # the first call come under inference mode, the check still needs autograd.
    results = []
    try:
        with (
            torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            generator = torch.Generator(device=device).manual_seed(0)
            counts = torch.tensor([3, 0, 5, 8], device=device)  # uneven groups and an idle expert

            def draw(*shape: int) -> torch.Tensor:
                return (torch.randn(*shape, generator=generator, device=device) / shape[-1] ** 0.5).to(dtype)

            inputs = [draw(16, dim), draw(4, hidden, dim), draw(4, dim, hidden), draw(4, hidden, dim)]
            grad = draw(16, dim)  # a plain gradient: the layer's weighting multiply always makes one
            for ffn in (grouped_expert_ffn, grouped_mm_expert_ffn):
                leaves = [t.clone().requires_grad_() for t in inputs]
                out = ffn(leaves[0], counts.tolist() if ffn is grouped_expert_ffn else counts, *leaves[1:])
                results.append([out.detach(), *torch.autograd.grad(out, leaves, grad)])
    except Exception:  # any failure of a private kernel (unsupported dtype, strides, device): the loop
        return False
    tolerance = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2  # bf16/fp16 round at ~4e-3
    return all(
        a.shape == b.shape and float((a.float() - b.float()).abs().max()) <= tolerance * max(1.0, float(a.float().abs().max()))
        for a, b in zip(*results)
    )


def in_recompute() -> bool:
    """True while autograd's backward runs this code: activation checkpointing recomputing a
    forward. Statistics must count each forward once, not again during recomputation.
    (torch has no public call for this; `_current_graph_task_id` is -1 outside backward.)"""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


CPU_LOOP_MIN_ROWS_PER_EXPERT = 512
"""On CPU, with this many rows per expert on average the per-expert loop is used.

`benchmarks/grouped_experts.py` (one thread): at 1,024 rows per expert (8 experts, dim 256,
hidden 512) the CPU `_grouped_mm` kernel was 5-11% slower than the loop's BLAS calls, while
at 64-128 rows per expert (tiny-moe; 64 experts) it was 1.5-4x faster, the loop's fixed
per-expert cost dominating. On GPUs the grouped kernel is used whenever it works."""


def prefer_grouped_mm(rows: torch.Tensor, n_experts: int) -> bool:
    return rows.device.type != "cpu" or rows.shape[0] < CPU_LOOP_MIN_ROWS_PER_EXPERT * n_experts


CPU_LOOP_MIN_ROWS_PER_BLOCK = 128
"""Where the loop runs (see above) on rows in blocks (expert parallelism's arrivals: one block
per source rank and expert), with this many rows per block on average it runs block by block
instead of regrouping the rows by expert first (a permuting copy of every row, undone after,
both again in backward). `benchmarks/expert_arrival_blocks.py` (one thread, forward +
backward, two runs): 32 local experts, hidden 128, ep=2, ~512 rows per block (the DeepSpeed
comparison's fine grain): blocks 220-225 ms, regroup + loop 267-280 ms; ~128 rows per block:
even (64 ms against 63 ms); ~64 rows per block (ep=8): blocks 15% slower, a matmul's fixed
cost per block then showing; 4 experts, hidden 512, ~1,024 rows per block: 197-204 ms
against 202-211 ms."""


def prefer_block_loop(rows: torch.Tensor, n_experts: int, n_blocks: int) -> bool:
    """Whether rows in `n_blocks` blocks for `n_experts` experts are best computed block by
    block where they lie (the loop, without a regroup by expert)."""
    return not prefer_grouped_mm(rows, n_experts) and rows.shape[0] >= CPU_LOOP_MIN_ROWS_PER_BLOCK * n_blocks


@dataclass(frozen=True)
class ExpertLoad:
    """What one MoE layer routed in the training forwards since the trainer last took it
    (`MoE.take_load`; recomputations not counted)."""

    tokens_per_expert: torch.Tensor | None
    """(experts,) token-expert assignments per expert after any capacity drop; None if none ran."""
    dropped: int
    """Assignments dropped by the capacity limit."""
    received: int
    """Rows this rank's experts computed: under expert parallelism, what its ep group sent it."""


class GroupedExperts(nn.Module):
    """The routed experts' stacked SwiGLU weights; forward takes rows already sorted by expert.

    Expert parallelism (`phalanx.parallel.expert.ShardedExperts`) subclasses it: forward then
    moves the rows to the ranks holding their experts around the same `compute`.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.onednn: Callable[[torch.Tensor, torch.Tensor], Callable | None] | None = None
        """Set from outside for inference on CPU (`phalanx.cpu_ops.onednn_linear.use_onednn`):
        given the rows and w1, the product the loop over experts should use for them (oneDNN's),
        or None where it does not apply (gradients wanted, another device or dtype)."""
        self.blocked: ExpertCopies | None = None
        """oneDNN's blocked copies of the experts' weights, where `use_onednn` keeps them."""
        self.received_tokens = 0
        """Rows these experts computed in training forwards (recomputations not counted) since
        the trainer last took them (`MoE.take_load`): under expert parallelism, the rows this
        rank received from its whole ep group."""

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows: (n, dim) sorted by expert; counts: (experts,) rows per expert -> (n, dim)."""
        return self.compute(rows, counts)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor, host_counts: list[int] | None = None) -> torch.Tensor:
        """This module's experts on rows sorted by expert; `host_counts`: the counts already on
        the host, if the caller has them (spares the per-expert loop a synchronization)."""
        self.count_received(rows)
        return self.ffn(rows, counts, host_counts)

    def count_received(self, rows: torch.Tensor) -> None:
        if self.training and not in_recompute():
            self.received_tokens += rows.shape[0]

    def loop_products(self, rows: torch.Tensor) -> dict:
        """How the loop over experts multiplies `rows` (`grouped_expert_ffn`'s `linear` or
        `blocked`): the product `onednn` picks for these rows (on the blocked copies where
        kept), where it is set and applies, else F.linear."""
        linear = self.onednn(rows, self.w1) if self.onednn else None
        if linear is None:
            return {"linear": F.linear}
        return {"blocked": self.blocked} if self.blocked else {"linear": linear}

    def ffn(self, rows: torch.Tensor, counts: torch.Tensor, host_counts: list[int] | None = None) -> torch.Tensor:
        """`compute` without the count: the grouped kernel where it is preferred and works, else
        the loop (through oneDNN for inference on CPU: the grouped kernel's CPU version loops
        over MKL's products, which oneDNN's beat, benchmarks/cpu_matmul.py)."""
        products = self.loop_products(rows)
        if (products.get("linear") is F.linear and rows.shape[0] and prefer_grouped_mm(rows, self.w1.shape[0])
                and grouped_mm_works(rows, self.w1)):
            return grouped_mm_expert_ffn(rows, counts, self.w1, self.w2, self.w3)
        # The loop also serves a rank that received no rows (see its empty case).
        host_counts = counts.tolist() if host_counts is None else host_counts
        return grouped_expert_ffn(rows, host_counts, self.w1, self.w2, self.w3, **products)


def capacity_keep(sorted_experts: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Mask over assignments sorted (stably) by expert: True for the first `capacity` of each.

    The sort is stable over token order, so an expert keeps its earliest tokens and drops the
    later ones: the same tokens on every run.
    """
    starts = torch.cumsum(counts, 0) - counts  # (experts,) first sorted position of each expert
    position = torch.arange(sorted_experts.numel(), device=counts.device) - starts[sorted_experts]
    return position < capacity


class WeightedCombine(torch.autograd.Function):
    """out[token] = sum of weight[a] * rows[a] over the kept assignments a of each token.

    Saves what the gradient needs: the rows (for the weights' gradient), the weights and the
    index. Written as a multiply and `index_add_`, autograd would also keep the weighted rows,
    index_add_'s source, which its backward formula only reads for the shape (as many bytes
    again as the rows; tests/test_activation_cuts.py). `like`: the tokens (tokens, dim), whose
    dtype and shape the output takes; nothing of it is saved.
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, like: torch.Tensor):
        ctx.save_for_backward(rows, weights, index)
        return _weighted_sum(rows, weights, index, like)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weights, index = ctx.saved_tensors
        grad_rows = grad.index_select(0, index).to(rows.dtype)  # (kept assignments, dim)
        # A plain (not expanded) tensor: the grouped experts' CPU kernel rejects an expanded one.
        grad_weights = (grad_rows * rows).sum(-1, keepdim=True) if ctx.needs_input_grad[1] else None
        return grad_rows * weights, grad_weights, None, None


def _weighted_sum(rows: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like).index_add_(0, index, (rows * weights).to(like.dtype))  # (tokens, dim)


def combine(rows: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`WeightedCombine` where a gradient is wanted, else its arithmetic alone, without the
    autograd function's own cost per call (serving: `benchmarks/serve_step_ab.py --variant
    combine`, 1.018x on the MoE closed loop's step time, 1.007-1.023)."""
    if torch.is_grad_enabled():
        return WeightedCombine.apply(rows, weights, index, like)
    return _weighted_sum(rows, weights, index, like)


class MoE(nn.Module):
    """Routed experts (+ optional shared experts) in place of a dense feed-forward.

    After each training forward it leaves behind, for the trainer: `aux_loss` (a scalar tensor
    in the graph, or None when no auxiliary loss is configured), and it adds to the
    `tokens_per_expert` and `dropped_tokens` counters, which `take_load` returns to the trainer
    (`phalanx.train.moe_stats`, once per optimizer step) and restarts.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.moe_ffn_dim
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.capacity_factor = cfg.capacity_factor
        self.router = Router(cfg.dim, cfg.n_experts, cfg.experts_per_token, score=cfg.router,
                             bias_rate=cfg.router_bias_rate, normalize=cfg.routing_normalized,
                             groups=cfg.expert_groups, topk_groups=cfg.topk_groups, scale=cfg.routed_scaling_factor)
        self.experts: GroupedExperts = GroupedExperts(cfg.n_experts, cfg.dim, hidden)
        """Under expert parallelism a `ShardedExperts` (`phalanx.parallel.expert.apply_ep`)."""
        self.shared = None
        if cfg.n_shared_experts:
            self.shared = FeedForward(cfg.dim, hidden * cfg.n_shared_experts)
        self.aux_loss: torch.Tensor | None = None
        """This training forward's auxiliary loss, in the graph, for the trainer
        (`phalanx.train.moe_aux_loss` consumes it); None in evaluation or without one."""
        # Plain attributes, not buffers: statistics, never checkpointed or synchronized by DDP.
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped_tokens = 0

    def take_load(self) -> ExpertLoad:
        """This layer's load since the last call, and its counters restarted."""
        load = ExpertLoad(tokens_per_expert=self.tokens_per_expert, dropped=self.dropped_tokens,
                          received=self.experts.received_tokens)
        self.tokens_per_expert, self.dropped_tokens, self.experts.received_tokens = None, 0, 0
        return load

    def capacity(self, n_tokens: int) -> int | None:
        if not self.capacity_factor:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (tokens, dim)
        route = self.router(tokens)
        flat_experts = route.experts.reshape(-1)  # (tokens * k,), assignment a is token a // k
        order = flat_experts.argsort(stable=True)  # assignments grouped by expert, token order within
        counts = count_per_expert(flat_experts, self.n_experts)  # (experts,)
        dropped = 0
        capacity = self.capacity(tokens.shape[0])
        if capacity is not None:
            keep = capacity_keep(flat_experts[order], counts, capacity)
            dropped = int((~keep).sum())
            order, counts = order[keep], counts.clamp(max=capacity)
        source_token = order // self.top_k
        # The rows in the compute dtype before they reach the experts: expert parallelism then
        # sends bf16, not fp32, under bf16 autocast (the experts' matmuls would cast them to
        # it anyway, so the numbers are the same).
        # index_select, not tokens[source_token]: its backward is an index_add, where advanced
        # indexing's is an accumulating index_put, slower on CPU.
        rows = tokens.index_select(0, source_token).to(compute_dtype(tokens))  # (kept assignments, dim)
        expert_out = self.experts(rows, counts)  # (kept assignments, dim)
        # Weight each assignment and add it back to its token; a dropped assignment adds nothing
        # (its token keeps the residual stream and its other experts).
        weights = route.weights.reshape(-1)[order, None].to(expert_out.dtype)  # (kept assignments, 1)
        out = combine(expert_out, weights, source_token, tokens)
        if self.shared is not None:
            out = out + self.shared(tokens)
        self._record(route, counts, dropped)
        return out.reshape(shape)

    def _record(self, route, counts: torch.Tensor, dropped: int) -> None:
        if not self.training:
            self.aux_loss = None
            return
        terms = []
        if self.aux_loss_coef:
            terms.append(self.aux_loss_coef * route.balance_loss())
        if self.z_loss_coef:
            terms.append(self.z_loss_coef * route.z_loss())
        if in_recompute():
            # Activation checkpointing re-running this forward in backward: the ops above must
            # still run (it checks that the same tensors are saved), but the loss was already
            # taken and the tokens already counted.
            return
        self.aux_loss = sum(terms) if terms else None
        counts = counts.detach()
        self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
        self.dropped_tokens += dropped
