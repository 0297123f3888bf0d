"""Which Hugging Face architecture computes the same function as a phalanx model, and its
config.json. Torch-free.

Dense models export as `llama` (or `mistral` with a sliding window, `qwen2` with q/k/v
biases only, `qwen3` with q/k norms); softmax-routed MoE models as `mixtral` (every layer
routed, weights renormalized, no q/k norms) or `qwen3_moe` (q/k norms; dense layers and
unnormalized weights allowed); latent attention as `deepseek_v3`. A model none of these can
express is a clear error.
"""

from __future__ import annotations

from phalanx.errors import UserError
from phalanx.model.config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}


def _refuse(cfg: ModelConfig, why: str) -> UserError:
    return UserError(f"model {cfg.name!r} has no Hugging Face equivalent: {why}")


def _deepseek_family(cfg: ModelConfig) -> str:
    """DeepseekV3ForCausalLM: latent attention, dense layers first, then sigmoid-routed experts
    with shared experts in every later layer."""
    if cfg.n_experts:
        if cfg.router != "sigmoid":
            raise _refuse(cfg, f"router={cfg.router!r} with latent attention (deepseek_v3 routes by sigmoid)")
        if not cfg.n_shared_experts:
            raise _refuse(cfg, "latent attention with experts but no shared expert (deepseek_v3 always has one)")
        if cfg.moe_every != 1 or cfg.dense_layers:
            raise _refuse(cfg, "dense layers other than the first n_dense_layers (deepseek_v3's first_k_dense_replace)")
        if cfg.capacity_factor:
            raise _refuse(cfg, f"capacity_factor={cfg.capacity_factor} drops tokens")
        if cfg.aux_loss_coef or cfg.z_loss_coef:
            raise _refuse(cfg, "a router loss (deepseek_v3's loss has none)")
    return "deepseek_v3"


def export_family(cfg: ModelConfig) -> str:
    if cfg.mlp != "swiglu":
        raise _refuse(cfg, f"mlp={cfg.mlp!r} (the exported architectures use SwiGLU)")
    if cfg.is_latent:
        return _deepseek_family(cfg)
    split_bias = cfg.attention_bias and not cfg.attention_out_bias
    if cfg.attention_out_bias and not cfg.attention_bias:
        raise _refuse(cfg, "an output-projection bias without q/k/v biases")
    if not cfg.n_experts:
        if cfg.qk_norm:
            family = "qwen3"
        elif split_bias:
            family = "qwen2"
        else:
            family = "mistral" if cfg.sliding_window else "llama"
        if cfg.sliding_window and family != "mistral":
            raise _refuse(cfg, f"a sliding window with {family}-style attention")
        return family
    if cfg.router != "softmax" or cfg.router_bias_rate:
        raise _refuse(cfg, f"router={cfg.router!r} with a balancing bias (the exported MoE families route by softmax)")
    if cfg.n_shared_experts:
        raise _refuse(cfg, "shared experts")
    if cfg.capacity_factor:
        raise _refuse(cfg, f"capacity_factor={cfg.capacity_factor} drops tokens")
    if split_bias:
        raise _refuse(cfg, "q/k/v biases in an MoE model")
    all_routed = cfg.n_moe_layers == cfg.n_layers
    if cfg.qk_norm:
        if cfg.sliding_window:
            raise _refuse(cfg, "a sliding window with q/k norms")
        return "qwen3_moe"
    if not (all_routed and cfg.routing_normalized and not cfg.attention_bias):
        raise _refuse(cfg, "an MoE model without q/k norms must route every layer, renormalize its "
                      "weights and have no attention biases (as mixtral)")
    return "mixtral"


def hf_config_dict(cfg: ModelConfig, family: str, *, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for `family`, in the form recent `transformers` writes (`rope_parameters`),
    with `rope_theta` and `rope_scaling` beside it for older readers."""
    rope: dict = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "llama3":
        rope.update(factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_seq_len)
    data = {
        "architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
        "bos_token_id": bos_id, "eos_token_id": eos_id, "dtype": "float32",
    }
    if family != "qwen2":
        data["attention_bias"] = cfg.attention_bias
    if family in ("llama",):
        data["mlp_bias"] = False
    if family in ("mistral", "mixtral"):
        data["sliding_window"] = cfg.sliding_window or None
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        data["use_sliding_window"] = False
    if family == "mixtral":
        data.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                    intermediate_size=cfg.moe_ffn_dim, router_jitter_noise=0.0)
    if family == "qwen3_moe":
        dense = [layer for layer in range(cfg.n_layers) if not cfg.is_moe_layer(layer) and (layer + 1) % cfg.moe_every == 0]
        data.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                    moe_intermediate_size=cfg.moe_ffn_dim, norm_topk_prob=cfg.routing_normalized,
                    decoder_sparse_step=cfg.moe_every, mlp_only_layers=dense)
    if family == "deepseek_v3":
        data.update(_deepseek_fields(cfg))
    if cfg.aux_loss_coef:
        data.update(output_router_logits=True, router_aux_loss_coef=cfg.aux_loss_coef)
    return data


def _yarn_parameters(cfg: ModelConfig) -> dict:
    rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len, "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow, "truncate": cfg.rope_truncate}
    optional = {"mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim,
                "attention_factor": cfg.rope_attention_factor}
    return {**rope, **{key: value for key, value in optional.items() if value}}


def _deepseek_fields(cfg: ModelConfig) -> dict:
    """DeepseekV3Config's own fields (head_dim as transformers writes it: the rotated part)."""
    dense = cfg.n_dense_layers if cfg.n_experts else cfg.n_layers
    data = dict(
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim,
        qk_head_dim=cfg.head_dim, rope_interleave=cfg.rope_interleave, first_k_dense_replace=dense,
        n_routed_experts=cfg.n_experts or 1, num_experts_per_tok=cfg.experts_per_token if cfg.n_experts else 1,
        moe_intermediate_size=cfg.moe_ffn_dim, n_shared_experts=cfg.n_shared_experts or 1,
        n_group=cfg.expert_groups, topk_group=cfg.topk_groups or cfg.expert_groups,
        norm_topk_prob=cfg.routing_normalized, routed_scaling_factor=cfg.routed_scaling_factor,
        num_nextn_predict_layers=0, attention_dropout=0.0,
    )
    if cfg.rope_type == "yarn":
        rope = _yarn_parameters(cfg)
        data.update(rope_parameters=rope, rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"})
    return data
