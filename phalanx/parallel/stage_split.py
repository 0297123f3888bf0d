"""Which modules each pipeline stage owns: a pure function of the model's shape.

A split is data, a list (one entry per stage) of module names:
    [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]
The embedding always goes with the first stage and the final norm and output projection
with the last; the transformer layers are cut into contiguous runs, either by hand
(`split=2:2` in the plan: layers per stage) or so that the most expensive stage is as cheap
as possible, counting the embedding and the output layer at their own cost.
"""

from __future__ import annotations

from phalanx.adapt_policy import weighted_layer_counts
from phalanx.model.config import ModelConfig
from phalanx.plan import parse_split


def unit_costs(cfg: ModelConfig, seq_len: int, tokens_per_microbatch: int) -> list[float]:
    """Cost of [embedding, layer 0, ..., layer n-1, norm+output] for one micro-batch, in FLOPs
    of forward plus backward (backward counted as twice forward).

    - a layer: 6 FLOPs per token per matrix parameter, plus causal attention scores and the
      weighted sum (forward 2 x seq x dim per token, halved by the causal mask, x3 with backward);
    - the output layer: a dim x vocab matrix (for large vocabularies it weighs as much as
      several layers), plus the softmax / cross-entropy over the vocabulary;
    - the embedding: almost no FLOPs, but backward writes a dense vocab x dim gradient each
      micro-batch, and the lookup moves dim values per token; both counted at one FLOP per
      element touched. Small, but not free.
    """
    dim, head_dim = cfg.dim, cfg.head_dim
    attention_params = dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    costs = [float(2 * cfg.vocab_size * dim + 2 * dim * tokens_per_microbatch)]
    for layer in range(cfg.n_layers):
        if cfg.is_moe_layer(layer):
            # Each token passes through its top-k experts (and shared ones) plus the router.
            mlp_params = 3 * dim * cfg.moe_ffn_dim * (cfg.experts_per_token + cfg.n_shared_experts)
            mlp_params += dim * cfg.n_experts
        else:
            mlp_params = (3 if cfg.mlp == "swiglu" else 2) * dim * cfg.ffn_dim
        per_token = 6 * (attention_params + mlp_params) + 3 * 2 * seq_len * cfg.n_heads * head_dim
        costs.append(float(per_token * tokens_per_microbatch))
    costs.append(float((6 * dim * cfg.vocab_size + 10 * cfg.vocab_size) * tokens_per_microbatch))
    return costs


def balanced_layer_counts(costs: list[float], n_stages: int) -> list[int]:
    """Layers per stage that minimize the most expensive stage, every stage equally fast
    (`adapt_policy.weighted_layer_counts`, which re-splits for stages of measured speeds, holds
    the rule). Of equally good splits, the earliest cuts win (earlier stages lighter): under
    1F1B the first stages keep the most micro-batches' activations in flight, so fewer layers
    there also saves peak memory.

    `costs` is [embedding, layers..., output] as from `unit_costs`; every stage gets at least
    one layer.
    """
    return weighted_layer_counts(costs, [1.0] * n_stages)


def stage_modules(layer_counts: list[int]) -> list[list[str]]:
    """Module names per stage for the given layers-per-stage."""
    stages, first = [], 0
    for index, count in enumerate(layer_counts):
        names = [f"layers.{i}" for i in range(first, first + count)]
        if index == 0:
            names.insert(0, "tok_embeddings")
        if index == len(layer_counts) - 1:
            names += ["norm", "output"]
        stages.append(names)
        first += count
    return stages


def stage_layer_counts(cfg: ModelConfig, n_stages: int, *, split: str = "", seq_len: int,
                       tokens_per_microbatch: int) -> list[int]:
    """Layers per stage: by hand when `split` is given, else balanced by cost."""
    if split:
        return parse_split(split, n_stages, cfg.n_layers)
    return balanced_layer_counts(unit_costs(cfg, seq_len, tokens_per_microbatch), n_stages)


def split_stages(cfg: ModelConfig, n_stages: int, *, split: str = "", seq_len: int,
                 tokens_per_microbatch: int) -> list[list[str]]:
    """Module names per stage: by hand when `split` is given, else balanced by cost."""
    return stage_modules(stage_layer_counts(cfg, n_stages, split=split, seq_len=seq_len,
                                            tokens_per_microbatch=tokens_per_microbatch))
