"""Model shapes: a typed description and the named presets.

The presets of public models (`llama3-*`, `mixtral-8x7b`, `deepseek-v3`) are only shapes:
the planner reads them and the model can be built on the meta device, never allocated here.
`deepseek-v3` is the real architecture (multi-head latent attention, group-limited routing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from phalanx.errors import UserError
from phalanx.model.shape_bounds import shape_problems


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a Llama-style decoder, optionally with mixture-of-experts feed-forwards."""
    name: str = "custom"
    vocab_size: int = 256
    """Byte-level models use 256; public presets use their tokenizer's size."""
    dim: int = 64
    """Hidden size h."""
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    """Grouped-query attention: each key/value head serves n_heads / n_kv_heads query heads."""
    head_dim: int = 0
    """Channels per attention head; 0 means dim // n_heads (Qwen3 sets it explicitly)."""
    attention_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    attention_out_bias: bool = False
    """A bias on the attention output projection (Llama's `attention_bias` sets both)."""
    qk_norm: bool = False
    """RMSNorm over each head's channels of queries and keys, before the rotation (Qwen3)."""
    sliding_window: int = 0
    """Each position attends to at most this many positions, itself included (Mistral); 0: all."""
    ffn_dim: int = 128
    """Inner size of the dense SwiGLU feed-forward."""
    mlp: str = "swiglu"
    """'swiglu' (gated, three matrices) or 'gelu' (plain 4h MLP, two matrices)."""
    rope_theta: float = 10000.0
    rope_type: str = "default"
    """'default', or 'llama3' (Llama 3.1's frequency-dependent scaling, the rope_* fields below)."""
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    n_experts: int = 0
    """Routed experts per MoE layer; 0 means a dense model."""
    experts_per_token: int = 2
    expert_ffn_dim: int = 0
    """Inner size of each routed expert (defaults to ffn_dim when 0)."""
    n_shared_experts: int = 0
    """Experts every token passes through, besides the routed ones (DeepSeek style)."""
    n_dense_layers: int = 0
    """In an MoE model, the first n_dense_layers layers keep a dense feed-forward."""
    moe_every: int = 1
    """In an MoE model, only layers with (layer + 1) % moe_every == 0 have experts (Qwen's
    `decoder_sparse_step`)."""
    dense_layers: tuple[int, ...] = ()
    """More layers that keep a dense feed-forward in an MoE model (Qwen's `mlp_only_layers`)."""
    norm_topk_prob: bool | None = None
    """Renormalize the chosen experts' scores to sum to one per token (Mixtral: yes; Qwen3-MoE:
    its config says). None (the presets): yes when experts_per_token > 1, no for top-1 routing,
    where the one weight normalized over itself is always 1 and the router would get no
    gradient from the loss. Read the decision from `routing_normalized`."""
    router: str = "softmax"
    """'softmax' (top-k of a softmax) or 'sigmoid' (DeepSeek-V3: top-k of per-expert sigmoid
    scores); either way the chosen scores are the combine weights, normalized or not as
    `norm_topk_prob` says."""
    router_bias_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): each step, every expert's routing bias moves
    by this much toward balance (down if it got more than the mean, up if less). The bias only
    changes which experts are chosen, never the combine weights. 0 stops the updates but keeps
    (freezes) a bias already learned, say by the run a checkpoint came from."""
    aux_loss_coef: float = 0.0
    """Weight of the Switch/GShard balance loss n_experts * sum_e(fraction_e * mean_score_e)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE), keeping logits small."""
    capacity_factor: float = 0.0
    """0: dropless. Otherwise each expert takes at most ceil(factor * tokens * k / n_experts)
    assignments per forward, the earliest tokens first, and drops the rest."""
    tie_embeddings: bool = False
    """The output projection shares the embedding's weight."""
    # Multi-head latent attention and DeepSeekMoE routing (DeepSeek-V2/V3): docs/models.md.
    kv_lora_rank: int = 0
    """0: grouped-query attention. Otherwise multi-head latent attention: keys and values are
    rebuilt per head from one compressed latent of this many channels per token (what the KV
    cache holds, with the rotated key part), `phalanx/model/latent_attention.py`."""
    q_lora_rank: int = 0
    """Latent attention's queries pass through a compressed latent of this size (0: plain queries)."""
    qk_rope_head_dim: int = 0
    """Channels of each query/key head that are rotated (shared by all heads on the key side)."""
    qk_nope_head_dim: int = 0
    """Channels of each query/key head without rotation; head_dim = qk_nope + qk_rope."""
    v_head_dim: int = 0
    """Channels of each value head (latent attention: need not equal head_dim)."""
    rope_interleave: bool = False
    """The rotated channels come in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's
    layout) instead of halves (i, i + d/2)."""
    rope_beta_fast: float = 32.0
    """YaRN: channels turning more than beta_fast times over the original context keep their
    frequency, those turning fewer than beta_slow times are interpolated by rope_factor."""
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    """YaRN's attention-scale correction: the rotated channels are scaled by
    mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim) (unless
    rope_attention_factor is set), and latent attention's softmax scale by
    mscale(factor, rope_mscale_all_dim)^2, with mscale(s, m) = 0.1 m ln(s) + 1."""
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: float = 0.0
    """YaRN: an explicit scale of the rotated channels (0: derived from the mscales)."""
    rope_truncate: bool = True
    """YaRN: round the band of blended channels outward to whole channels."""
    expert_groups: int = 1
    """Group-limited routing (`n_group`): experts fall into this many equal groups (a node's
    experts under expert parallelism), and each token chooses only among the experts of its
    `topk_groups` best groups, ranked by the sum of each group's two best scores."""
    topk_groups: int = 0
    """How many groups a token may choose from (`topk_group`); 0: all of them."""
    routed_scaling_factor: float = 1.0
    """The routed experts' combine weights are multiplied by this (after any normalization)."""
    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "moe_every"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be at least 1")
        if problems:  # the checks below divide by these
            raise UserError(f"model {self.name!r}: " + "; ".join(problems))
        if not self.head_dim and self.kv_lora_rank:
            object.__setattr__(self, "head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)

        if problems := shape_problems(self):  # before anything plans, builds or allocates for it
            raise UserError(f"model {self.name!r}: " + "; ".join(problems))
        if not self.head_dim:
            if self.dim % self.n_heads:
                problems.append(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.kv_lora_rank:
            problems += self._latent_problems()
        if self.rope_dim % 2:
            problems.append(f"the rotated channels ({self.rope_dim}) must be even for rotary embeddings")
        if self.rope_type not in ("default", "llama3", "yarn"):
            problems.append(f"rope_type={self.rope_type!r} must be 'default', 'llama3' or 'yarn'")
        if self.rope_type == "yarn" and not (self.rope_original_max_seq_len > 0 and self.rope_factor > 0):
            problems.append("rope_type='yarn' needs rope_original_max_seq_len > 0 and rope_factor > 0")
        if self.rope_type == "llama3" and not (self.rope_original_max_seq_len > 0 and self.rope_factor > 0
                                               and self.rope_high_freq_factor > self.rope_low_freq_factor > 0):
            problems.append("rope_type='llama3' needs rope_original_max_seq_len > 0, rope_factor > 0 and "
                            "rope_high_freq_factor > rope_low_freq_factor > 0")
        if self.sliding_window < 0:
            problems.append(f"sliding_window={self.sliding_window} must not be negative")
        if self.mlp not in ("swiglu", "gelu"):
            problems.append(f"mlp={self.mlp!r} must be 'swiglu' or 'gelu'")
        if self.n_experts and not 0 < self.experts_per_token <= self.n_experts:
            problems.append(
                f"experts_per_token={self.experts_per_token} must be in 1..n_experts={self.n_experts}"
            )
        if self.router not in ("softmax", "sigmoid"):
            problems.append(f"router={self.router!r} must be 'softmax' or 'sigmoid'")
        for name in ("router_bias_rate", "aux_loss_coef", "z_loss_coef", "capacity_factor"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must not be negative")
        if self.n_experts:
            problems += self._group_problems()
        if problems:
            raise UserError(f"model {self.name!r}: " + "; ".join(problems))

    def _latent_problems(self) -> list[str]:
        """Latent attention: a head split that adds up, and no GQA-only feature."""
        least = {"kv_lora_rank": 1, "qk_rope_head_dim": 1, "v_head_dim": 1, "q_lora_rank": 0, "qk_nope_head_dim": 0}
        problems = [f"{name}={getattr(self, name)} must be at least {low} for latent attention"
                    for name, low in least.items() if getattr(self, name) < low]
        split = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim != split:
            problems.append(f"inconsistent head split: head_dim={self.head_dim} must equal qk_nope_head_dim="
                            f"{self.qk_nope_head_dim} + qk_rope_head_dim={self.qk_rope_head_dim} = {split}")
        if self.n_kv_heads != self.n_heads:
            problems.append(f"latent attention rebuilds keys and values for every head: n_kv_heads="
                            f"{self.n_kv_heads} must equal n_heads={self.n_heads}")
        for name in ("qk_norm", "sliding_window", "attention_bias", "attention_out_bias"):
            if getattr(self, name):
                problems.append(f"{name}={getattr(self, name)} is not supported with latent attention")
        return problems

    def _group_problems(self) -> list[str]:
        """Group-limited routing: groups that divide the experts and can supply k of them."""
        groups, topk = self.expert_groups, self.topk_groups or self.expert_groups
        if groups < 1 or self.n_experts % groups:
            return [f"n_experts={self.n_experts} cannot be divided into expert_groups={groups} equal groups"]
        if not 1 <= topk <= groups:
            return [f"topk_groups={self.topk_groups} must be in 1..expert_groups={groups}"]
        if topk * (self.n_experts // groups) < self.experts_per_token:
            return [f"topk_groups={topk} groups of {self.n_experts // groups} experts cannot supply "
                    f"experts_per_token={self.experts_per_token}"]
        if self.routed_scaling_factor <= 0:
            return [f"routed_scaling_factor={self.routed_scaling_factor} must be positive"]
        return []

    @property
    def is_latent(self) -> bool:
        """Multi-head latent attention (kv_lora_rank > 0) rather than grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Rotated channels per head: all of head_dim, or latent attention's qk_rope_head_dim."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def value_dim(self) -> int:
        """Channels per value head."""
        return self.v_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def kv_cache_values_per_token(self) -> int:
        """Values one layer caches per token for generation: the latent and the rotated key
        part with latent attention (576 for DeepSeek-V3), keys and values of every KV head
        otherwise."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.n_kv_heads * (self.head_dim + self.value_dim)

    @property
    def routing_normalized(self) -> bool:
        """Whether the chosen experts' weights are renormalized (`norm_topk_prob` resolved)."""
        return self.experts_per_token > 1 if self.norm_topk_prob is None else self.norm_topk_prob

    @property
    def moe_ffn_dim(self) -> int:
        return self.expert_ffn_dim or self.ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (self.n_experts > 0 and layer >= self.n_dense_layers and layer not in self.dense_layers
                and (layer + 1) % self.moe_every == 0)

    @property
    def n_moe_layers(self) -> int:
        """How many layers `is_moe_layer` picks, in closed form: the planner reads it for models of
        any declared depth, so its work must not grow with the layer count."""
        if not self.n_experts:
            return 0
        first, every = max(0, min(self.n_dense_layers, self.n_layers)), self.moe_every
        # Layers i in [first, n_layers) with (i + 1) % every == 0: multiples of `every` in (first, n_layers].
        count = self.n_layers // every - first // every
        return count - sum(1 for layer in set(self.dense_layers)
                           if first <= layer < self.n_layers and (layer + 1) % every == 0)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain JSON-able values (checkpoints record the model they hold)."""
        return {**dataclasses.asdict(self), "dense_layers": list(self.dense_layers)}

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {field.name for field in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        return cls(**{**values, "dense_layers": tuple(values.get("dense_layers", ()))})


DEEPSEEK_V3_ATTENTION = dict(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                             v_head_dim=128, rope_interleave=True)

PRESETS: dict[str, ModelConfig] = {
    cfg.name: cfg
    for cfg in [
        # Tests: four layers so that pipelines of 2 stages x 2 virtual chunks exist.
        ModelConfig(name="tiny", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256),
        # Tests: 4 KV heads for tp=4, six layers for the README's pp=4,split=1:2:2:1.
        ModelConfig(name="tiny-kv4", dim=64, n_layers=6, n_heads=4, n_kv_heads=4, ffn_dim=128, max_seq_len=256),
        # Tests and demos: every DeepSeek-V3 feature (compressed queries, YaRN past a 64-position
        # original context, interleaved rope, a dense first layer, shared expert, 4 groups of 2
        # experts with 2 groups per token, the learned routing bias, routed scaling), bytes in.
        ModelConfig(
            name="tiny-dsv3", dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=128, max_seq_len=256,
            kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            rope_interleave=True, rope_type="yarn", rope_factor=4.0, rope_original_max_seq_len=64,
            rope_mscale=1.0, rope_mscale_all_dim=1.0, norm_eps=1e-6,
            n_experts=8, experts_per_token=2, expert_ffn_dim=32, n_shared_experts=1, n_dense_layers=1,
            router="sigmoid", router_bias_rate=1e-3, expert_groups=4, topk_groups=2,
            routed_scaling_factor=2.5, norm_topk_prob=True,
        ),
        ModelConfig(
            name="tiny-moe", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128,
            n_experts=8, experts_per_token=2, expert_ffn_dim=64, max_seq_len=256,
        ),
        # The `phalanx train` default: learns visibly from bytes in a few CPU minutes.
        ModelConfig(name="small", dim=192, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=512, max_seq_len=1024),
        ModelConfig(
            name="small-moe", dim=192, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=512,
            n_experts=8, experts_per_token=2, expert_ffn_dim=256, max_seq_len=1024,
            router="sigmoid", router_bias_rate=1e-3,
        ),
        # Public shapes, for the planner and meta-device dry runs.
        ModelConfig(
            name="llama3-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
            ffn_dim=14336, rope_theta=500000.0, max_seq_len=8192,
        ),
        ModelConfig(
            name="llama3-70b", vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
            ffn_dim=28672, rope_theta=500000.0, max_seq_len=8192,
        ),
        ModelConfig(
            name="llama3-405b", vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
            ffn_dim=53248, rope_theta=500000.0, max_seq_len=8192,
        ),
        ModelConfig(
            name="mixtral-8x7b", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
            ffn_dim=14336, n_experts=8, experts_per_token=2, expert_ffn_dim=14336,
            rope_theta=1e6, max_seq_len=32768,
        ),
        # DeepSeek-V3/R1 as its config.json describes it (latent attention, YaRN for 160K, 8 groups
        # of 32 experts with 4 groups per token, the bias updated at DeepSeek's 0.001).
        ModelConfig(
            name="deepseek-v3", vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
            ffn_dim=18432, n_experts=256, experts_per_token=8, expert_ffn_dim=2048,
            n_shared_experts=1, n_dense_layers=3, max_seq_len=163840, norm_eps=1e-6,
            **DEEPSEEK_V3_ATTENTION, rope_type="yarn", rope_factor=40.0, rope_original_max_seq_len=4096,
            rope_mscale=1.0, rope_mscale_all_dim=1.0, router="sigmoid", router_bias_rate=1e-3,
            expert_groups=8, topk_groups=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        ),
    ]
}
