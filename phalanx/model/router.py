"""Token-to-expert routers: softmax top-k, and sigmoid scores with loss-free balancing bias.

The router decides which experts a token visits (`experts`) and with what weights their
outputs are summed (`weights`). Balancing acts on the choice only:
  * the DeepSeek-V3 bias is added to the scores before top-k and never to the weights, so it
    steers tokens without changing what the chosen experts contribute (no gradient, no loss);
  * the optional auxiliary and z losses are returned for the trainer to add to the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def count_per_expert(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(n_experts,) how many entries of `experts` name each expert. Not torch.bincount: on
    CUDA that reads the largest id back to the host to size its output, a synchronization
    per call; the size is known here."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


@dataclass
class Routing:
    experts: torch.Tensor
    """(tokens, k) chosen expert ids."""
    weights: torch.Tensor
    """(tokens, k) fp32 combine weights of the chosen experts (summing to one per token when
    the router normalizes them)."""
    scores: torch.Tensor
    """(tokens, experts) fp32 affinities: softmax probabilities or sigmoid scores."""
    logits: torch.Tensor
    """(tokens, experts) fp32 gate outputs."""

    def balance_loss(self) -> torch.Tensor:
        """Switch/GShard loss n_experts * sum_e(f_e * p_e), 1.0 when perfectly balanced.

        f_e is the fraction of assignments that went to expert e (no gradient), p_e the mean
        normalized score of e (differentiable), over this forward's tokens. Under data
        parallelism each rank computes it on its own micro-batch, as Megatron-Core and
        torchtitan do, so it is not the same number as one process's loss on the global batch.
        """
        n_experts = self.scores.shape[-1]
        fraction = count_per_expert(self.experts, n_experts).float() / self.experts.numel()
        probs = self.scores / self.scores.sum(dim=-1, keepdim=True)  # (tokens, experts), rows sum to 1
        return n_experts * (fraction * probs.mean(dim=0)).sum()

    def z_loss(self) -> torch.Tensor:
        """ST-MoE router z-loss: mean squared log-partition of the logits."""
        return torch.logsumexp(self.logits, dim=-1).square().mean()


def best_groups_mask(choice: torch.Tensor, groups: int, topk_groups: int) -> torch.Tensor:
    """(tokens, experts) bool: the experts of each token's `topk_groups` best groups.

    Group-limited routing (DeepSeek-V3's node-limited routing): the experts fall into `groups`
    equal contiguous groups (under expert parallelism, the experts of one node), each group is
    ranked by the sum of its two best choice scores, and a token may only choose experts of
    its best groups, so its dispatch reaches at most `topk_groups` nodes."""
    tokens, n_experts = choice.shape
    per_group = choice.view(tokens, groups, n_experts // groups)  # (tokens, groups, experts per group)
    group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)  # (tokens, groups)
    best = group_score.topk(topk_groups, dim=-1).indices  # (tokens, topk_groups)
    chosen = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    return chosen[:, :, None].expand_as(per_group).reshape(tokens, n_experts)


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int, *, score: str = "softmax", bias_rate: float = 0.0,
                 normalize: bool = True, groups: int = 1, topk_groups: int = 0, scale: float = 1.0):
        super().__init__()
        self.top_k, self.score, self.bias_rate, self.normalize = top_k, score, bias_rate, normalize
        self.groups, self.topk_groups, self.scale = groups, topk_groups or groups, scale
        self.gate = nn.Linear(dim, n_experts, bias=False)
        # Persistent: a resumed run must keep balancing from where it was.
        self.register_buffer("expert_bias", torch.zeros(n_experts))

    def reset_buffers(self) -> None:
        """Zero the balancing bias (after `to_empty` from the meta device)."""
        self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.gate(x).float()  # (tokens, experts)
        scores = F.softmax(logits, dim=-1) if self.score == "softmax" else torch.sigmoid(logits)
        # The bias picks experts; the weights come from the unbiased scores. Added whatever
        # bias_rate is: rate 0 freezes a learned bias (zero unless one was learned or loaded,
        # and adding zeros changes no score).
        choice = scores + self.expert_bias
        if self.topk_groups < self.groups:
            choice = choice.masked_fill(~best_groups_mask(choice, self.groups, self.topk_groups), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices  # (tokens, k)
        chosen = scores.gather(-1, experts)  # (tokens, k)
        if self.normalize:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            chosen = chosen * self.scale  # DeepSeek's routed_scaling_factor, after normalizing
        return Routing(experts=experts, weights=chosen, scores=scores, logits=logits)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Move each expert's bias by bias_rate toward balance, from the step's global counts.

        sign(mean - count): an overloaded expert becomes less attractive, an idle one more.
        Every rank must pass the same (globally reduced) counts so biases stay identical.
        """
        if self.bias_rate:
            load = tokens_per_expert.float()
            self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)
