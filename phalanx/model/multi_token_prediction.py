"""DeepSeek-V3's multi-token-prediction (MTP) module, for one device (arXiv 2412.19437,
section 2.2).

A module k = 1 predicts the token after the next one: at position i it combines the main
model's hidden state h_i with the embedding of the next token t_{i+1},
    x_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])    (2 dim -> dim)
runs x through one decoder layer of its own (latent attention over its own keys of positions
<= i, then DeepSeekMoE: the model's `Block`, numbered after the model's layers), and reads the
logits of t_{i+2} through its `shared_head` (a norm and a vocabulary projection). The
embedding is the main model's (shared, as the report says; checkpoints carry a copy).

Two conventions the report's formula leaves open are those of the checkpoints as vLLM and
SGLang read them (vllm/model_executor/models/deepseek_mtp.py): the embedding comes first in the
concatenation (the report writes h first), and h_i is the main model's last hidden state after
its final norm (what vLLM's DeepseekV2Model returns and its EAGLE proposer passes on). vLLM also
zeroes the embedding at position 0; here position 0 is like any other, as in the report (it
changes the draft only, never what is served: every draft is checked by the model itself).

The serving engine uses it as the draft of speculative decoding (`serve/mtp_draft.py`);
training with it is not there yet.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.model.config import ModelConfig
from phalanx.model.kv_cache import AttentionCache
from phalanx.model.rms_norm import RMSNorm
from phalanx.model.transformer import Block


class SharedHead(nn.Module):
    """The module's output norm and vocabulary projection (checkpoint: shared_head.norm, .head)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))  # (..., vocab)


class MultiTokenPrediction(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        """`layer`: its number among the model's layers (the first MTP module is n_layers): the
        checkpoint's, and the key its attention caches under."""
        super().__init__()
        self.layer = layer
        self.enorm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg, layer)
        self.shared_head = SharedHead(cfg)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor,
                cache: AttentionCache | None = None) -> torch.Tensor:
        """hidden (batch, seq, dim): the main model's final-normed hidden state at each position
        i; embedded (batch, seq, dim): Emb(t_{i+1}); rope: the main model's rotary tables ->
        this module's hidden state at each position (batch, seq, dim), before `shared_head`.
        With a `cache` the positions are the cache's, and their keys are added to it."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))  # (batch, seq, dim)
        return self.block(x, rope, cache) if cache is not None else self.block(x, rope)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """This module's hidden states (..., dim) -> the logits of the token after the next (..., vocab)."""
        return self.shared_head(h)


def build_multi_token_prediction(cfg: ModelConfig, layer: int) -> MultiTokenPrediction:
    """The module with every tensor on the meta device (filled by `init.fill_weights`)."""
    with torch.device("meta"):
        return MultiTokenPrediction(cfg, layer)
