"""How large a model shape may be: the bounds every ModelConfig is checked against, in one
place, so that no command plans, builds or allocates for a shape beyond any real machine (a
model file declaring 10^12 layers, or a hidden size of 10^9). Torch-free.

Each bound is far above the largest published model, so it only ever catches typos and
nonsense: Llama 3 405B has 126 layers, hidden size 16,384, feed-forward 53,248, 128 heads and a
131,072-position context; DeepSeek-V3 has 256 routed experts; the largest vocabularies are
about 256,000 tokens; and the largest training clusters hold about 10^5 GPUs of 192 GB, some
10^16 bytes, or about 10^15 parameters at the 16 bytes of weights, gradient and AdamW moments.
"""

from __future__ import annotations

WHY = "far above any published model; a larger value is a typo"

LIMITS = {
    "dim": 2**20, "ffn_dim": 2**22, "expert_ffn_dim": 2**22, "head_dim": 2**14,
    "n_heads": 2**16, "n_kv_heads": 2**16, "vocab_size": 2**24, "max_seq_len": 2**27, "n_experts": 2**16,
    "experts_per_token": 2**16, "n_shared_experts": 2**10, "sliding_window": 2**27,
    "rope_original_max_seq_len": 2**27,
}
"""The layer count is not here: the planner prices repeated layers by their count (issue 25),
so a shape is bounded in depth by its parameters alone, and a model built in one process by
`MAX_BUILT_LAYERS`."""
MAX_PARAMETERS = 10**15
MAX_BUILT_LAYERS = 2**14
"""Layers a process builds (`phalanx.model.init.build_model`): each is a few dozen Python
objects that every verb running a model visits one by one (building, sharding, checkpointing),
so that work grows with the depth; 130 times the deepest published model (Llama 3 405B, 126)."""


def approximate_parameters(cfg) -> int:
    """Weights to first order: attention, feed-forwards (all experts), embeddings."""
    head_dim = cfg.head_dim or cfg.dim // max(cfg.n_heads, 1)
    attention = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    experts = cfg.n_experts + cfg.n_shared_experts if cfg.n_experts else 1
    feed_forward = 3 * cfg.dim * (cfg.expert_ffn_dim or cfg.ffn_dim) * experts
    return cfg.n_layers * (attention + feed_forward) + 2 * cfg.vocab_size * cfg.dim


def shape_problems(cfg) -> list[str]:
    """What in `cfg` is beyond the bounds, each with the bound."""
    problems = [f"{name}={getattr(cfg, name):,} is above {limit:,}" for name, limit in LIMITS.items()
                if isinstance(getattr(cfg, name, 0), int) and getattr(cfg, name, 0) > limit]
    if problems:
        return [f"{', '.join(problems)} ({WHY})"]
    if (params := approximate_parameters(cfg)) > MAX_PARAMETERS:
        return [f"about {params:.2g} parameters is above {MAX_PARAMETERS:.0e} (what the largest clusters' memory "
                "holds for training)"]
    return []


def build_problem(cfg) -> str:
    """Why a process should not build `cfg`'s modules (`MAX_BUILT_LAYERS`), or ""."""
    if cfg.n_layers > MAX_BUILT_LAYERS:
        return (f"model {cfg.name!r}: n_layers={cfg.n_layers:,} is above {MAX_BUILT_LAYERS:,}, the most a process "
                "builds (far above any published model; `phalanx plan` prices any depth)")
    return ""
