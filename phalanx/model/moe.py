"""Mixture-of-experts feed-forward for one device: top-k softmax router and local experts.

Expert weights are stacked into (n_experts, ...) tensors so that expert parallelism can
shard them along dim 0, and tokens are processed grouped by expert (sorted, then one
contiguous slice per expert) rather than masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.model.config import ModelConfig


def grouped_expert_ffn(
    x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of each contiguous group of rows of x with its own expert's weights.

    x: (tokens, dim) sorted by expert; counts[e] rows belong to expert e;
    w1, w3: (experts, hidden, dim); w2: (experts, dim, hidden).
    """
    outputs = []
    for expert, rows in enumerate(torch.split(x, counts)):
        if rows.shape[0] == 0:
            continue
        hidden = F.silu(rows @ w1[expert].t()) * (rows @ w3[expert].t())  # (rows, hidden)
        outputs.append(hidden @ w2[expert].t())  # (rows, dim)
    if not outputs:
        return x.new_zeros(x.shape) + 0 * (w1.sum() + w2.sum() + w3.sum())
    return torch.cat(outputs)


class Router(nn.Module):
    """Softmax over experts, keep the top k and renormalize their weights to sum to one."""

    def __init__(self, dim: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.gate(x).float(), dim=-1)  # (tokens, experts)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (tokens, k)
        return weights / weights.sum(dim=-1, keepdim=True), experts


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.moe_ffn_dim
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.router = Router(cfg.dim, cfg.n_experts, cfg.experts_per_token)
        self.w1 = nn.Parameter(torch.empty(cfg.n_experts, hidden, cfg.dim))
        self.w2 = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, hidden))
        self.w3 = nn.Parameter(torch.empty(cfg.n_experts, hidden, cfg.dim))
        self.shared = None
        if cfg.n_shared_experts:
            from phalanx.model.transformer import FeedForward

            self.shared = FeedForward(cfg.dim, hidden * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (tokens, dim)
        weights, experts = self.router(tokens)  # (tokens, k) each
        flat_experts = experts.reshape(-1)  # (tokens * k,)
        order = flat_experts.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat_experts, minlength=self.n_experts).tolist()
        source_token = order // self.top_k
        expert_out = grouped_expert_ffn(tokens[source_token], counts, self.w1, self.w2, self.w3)
        # Weight each assignment and add it back to its token.
        expert_out = expert_out * weights.reshape(-1)[order, None].to(expert_out.dtype)
        out = torch.zeros_like(tokens).index_add_(0, source_token, expert_out.to(tokens.dtype))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(shape)
