"""Reading a Hugging Face `config.json` into a `ModelConfig`: one reader for training, export
and the planner. Torch-free, so `phalanx plan` can use it.

Trainable architectures (`TRAINABLE`) are read exactly: every field that changes what the
model computes is either carried into `ModelConfig` or refused with an error naming it, never
ignored. A few more families (`SHAPE_ONLY`) are read for planning only, as shapes whose FLOPs
and parameter counts match to first order; training or loading weights for them is refused.

Both forms of the rotary settings are read: `rope_theta` beside `rope_scaling` (as most
published checkpoints have them) and `rope_parameters` (as recent `transformers` writes them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from phalanx.errors import UserError
from phalanx.model.config import PRESETS, ModelConfig

TRAINABLE = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")
SHAPE_ONLY = ("qwen2_moe", "gpt2")


def is_model_path(name: str) -> bool:
    """Whether a `--model` value names a file or folder rather than a preset."""
    path = Path(name).expanduser()
    return path.exists() or path.suffix == ".json" or "/" in name


def config_path(name: str | Path) -> Path:
    """The config.json of a model directory, or the file itself."""
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise UserError(f"model directory {str(name)!r} has no config.json")
    elif not path.is_file():
        raise UserError(f"model {str(name)!r}: no such file or directory")
    return path


def model_directory(name: str) -> Path | None:
    """The folder holding a model's files (config.json, weights, tokenizer), None for presets."""
    if name in PRESETS or not is_model_path(name):
        return None
    return config_path(name).parent


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise UserError(f"cannot read {str(path)!r}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"{str(path)!r} is not text (a binary file?); expected JSON") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise UserError(f"{str(path)!r}: expected a JSON object, got {type(data).__name__}")
    return data


def read_model_config(name: str | Path, *, trainable: bool = True) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory or config.json (`trainable=False`: also the
    shape-only families, for the planner)."""
    path = config_path(name)
    return from_hf_dict(read_json(path), source=str(path), trainable=trainable)


class _Fields:
    """Typed access to a config dict, with errors that name the file and the key."""
    def __init__(self, data: dict, source: str, family: str):
        self.data, self.source, self.family = data, source, family

    def need(self, key: str, kind: type = int) -> Any:
        if self.data.get(key) is None:
            raise UserError(f"{self.source}: {self.family} config.json has no {key!r}")
        return self.get(key, None, kind)

    def get(self, key: str, default: Any, kind: type = int) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserError(f"{self.source}: {key} must be a number, got {value!r}")
        if kind is int and value != int(value):
            raise UserError(f"{self.source}: {key} must be an integer, got {value!r}")
        if kind is bool and not isinstance(value, bool):
            raise UserError(f"{self.source}: {key} must be true or false, got {value!r}")
        return kind(value)

    def refuse(self, key: str, allowed, why: str) -> None:
        """Error if `key` is present with a value outside `allowed` (the math would differ)."""
        if key in self.data and self.data[key] not in allowed:
            raise UserError(f"{self.source}: {key}={self.data[key]!r} is not supported ({why})")


def _rope(fields: _Fields) -> dict:
    """rope_theta and scaling from either config form."""
    data = fields.data
    params = data.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params and "rope_type" not in params:
        raise UserError(f"{fields.source}: per-layer-type rope_parameters are not supported")
    scaling = params if isinstance(params, dict) else data.get("rope_scaling")
    theta = (params or {}).get("rope_theta") if isinstance(params, dict) else None
    theta = float(theta if theta is not None else fields.get("rope_theta", 10000.0, float))
    out: dict = {"rope_theta": theta}
    if not scaling:
        return out
    if not isinstance(scaling, dict):
        raise UserError(f"{fields.source}: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return out
    if kind == "yarn" and fields.family == "deepseek_v3":
        return {**out, **_yarn(fields, scaling)}
    if kind != "llama3":
        supported = "default, llama3, yarn" if fields.family == "deepseek_v3" else "default, llama3"
        raise UserError(f"{fields.source}: rope type {kind!r} is not supported (supported: {supported})")
    try:
        out.update(rope_type="llama3", rope_factor=float(scaling["factor"]),
                   rope_low_freq_factor=float(scaling["low_freq_factor"]),
                   rope_high_freq_factor=float(scaling["high_freq_factor"]),
                   rope_original_max_seq_len=int(scaling["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as error:
        raise UserError(f"{fields.source}: llama3 rope scaling lacks or mangles {error}") from None
    if scaling.get("attention_factor") not in (None, 1, 1.0):
        raise UserError(f"{fields.source}: rope attention_factor={scaling['attention_factor']} is not supported")
    return out


def _yarn(fields: _Fields, scaling: dict) -> dict:
    """YaRN's settings, with transformers' defaults (`_compute_yarn_parameters`)."""
    max_len = fields.get("max_position_embeddings", 2048)
    try:
        original = int(scaling.get("original_max_position_embeddings") or max_len)
        factor = float(scaling["factor"]) if scaling.get("factor") is not None else max_len / original
        return dict(rope_type="yarn", rope_factor=factor, rope_original_max_seq_len=original,
                    rope_beta_fast=float(scaling.get("beta_fast") or 32), rope_beta_slow=float(scaling.get("beta_slow") or 1),
                    rope_mscale=float(scaling.get("mscale") or 0), rope_mscale_all_dim=float(scaling.get("mscale_all_dim") or 0),
                    rope_attention_factor=float(scaling.get("attention_factor") or 0),
                    rope_truncate=bool(scaling.get("truncate", True)))
    except (TypeError, ValueError) as error:
        raise UserError(f"{fields.source}: yarn rope scaling mangles a value ({error})") from None


DEEPSEEK_DEFAULTS = dict(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                         v_head_dim=128, n_group=8, topk_group=4, routed_scaling_factor=2.5, n_shared_experts=1,
                         first_k_dense_replace=3, rope_interleave=True)
"""DeepseekV3Config's defaults for the fields a config.json may leave out (transformers reads
an absent field as its default, and so does phalanx)."""

DEEPSEEK_BIAS_RATE = 1e-3
"""DeepSeek-V3's bias update speed gamma (arXiv 2412.19437, section 4.2), phalanx's router_bias_rate."""

SAID: set[str] = set()
"""Notes already printed by this process (each is said once)."""


def _is_null(fields: _Fields, key: str) -> bool:
    return key in fields.data and fields.data[key] is None


def _deepseek(fields: _Fields) -> dict:
    """Latent attention and DeepSeekMoE (docs/models.md lists each field and what is skipped)."""
    def get(key: str, kind: type = int):
        return fields.get(key, DEEPSEEK_DEFAULTS[key], kind)

    fields.refuse("attention_bias", (False, None), "latent attention without biases")
    fields.refuse("attention_dropout", (0, 0.0, None), "attention dropout changes training")
    fields.refuse("scoring_func", ("sigmoid", None), "DeepSeek-V3 routes by sigmoid scores")
    fields.refuse("topk_method", ("noaux_tc", None), "group-limited routing with the score-correction bias")
    fields.refuse("moe_layer_freq", (1, None), "every layer after first_k_dense_replace has experts")
    nope, rope = get("qk_nope_head_dim"), get("qk_rope_head_dim")
    if fields.data.get("qk_head_dim") not in (None, nope + rope):
        raise UserError(f"{fields.source}: inconsistent head split: qk_head_dim={fields.data['qk_head_dim']} but "
                        f"qk_nope_head_dim={nope} + qk_rope_head_dim={rope} = {nope + rope}")
    extra = fields.get("num_nextn_predict_layers", 0)
    if extra and fields.source not in SAID:
        SAID.add(fields.source)
        print(f"phalanx: {fields.source}: num_nextn_predict_layers={extra} multi-token prediction layer(s) "
              "skipped (the model predicts the next token only; serve --speculative-config deepseek_mtp drafts with the "
              "first)", file=sys.stderr)
    heads = fields.need("num_attention_heads")
    return dict(
        dim=fields.need("hidden_size"), n_heads=heads, n_kv_heads=fields.get("num_key_value_heads", heads),
        # q_lora_rank null (present, not absent): plain query projections
        kv_lora_rank=get("kv_lora_rank"), q_lora_rank=0 if _is_null(fields, "q_lora_rank") else get("q_lora_rank"),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope, v_head_dim=get("v_head_dim"), rope_interleave=get("rope_interleave", bool),
        n_experts=fields.need("n_routed_experts"), experts_per_token=fields.need("num_experts_per_tok"),
        expert_ffn_dim=fields.need("moe_intermediate_size"), n_shared_experts=get("n_shared_experts"),
        n_dense_layers=get("first_k_dense_replace"), router="sigmoid",
        norm_topk_prob=fields.get("norm_topk_prob", True, bool),  # DeepseekV3Config's default
        expert_groups=get("n_group"), topk_groups=get("topk_group"),
        routed_scaling_factor=get("routed_scaling_factor", float),
        # Training goes on balancing as DeepSeek-V3 was trained: the score-correction bias moves
        # by 0.001 a step (its paper's bias update speed); inference never reads the rate.
        router_bias_rate=DEEPSEEK_BIAS_RATE,
    )


def _attention(fields: _Fields, family: str) -> dict:
    heads = fields.need("num_attention_heads")
    dim = fields.need("hidden_size")
    head_dim = fields.get("head_dim", 0)  # null or absent: hidden size over heads
    out = dict(dim=dim, n_heads=heads, n_kv_heads=fields.get("num_key_value_heads", heads), head_dim=head_dim)
    if family == "qwen2":
        out["attention_bias"] = True  # Qwen2 always has q/k/v biases, never an output bias
    else:
        bias = fields.get("attention_bias", False, bool)
        out.update(attention_bias=bias, attention_out_bias=bias)
    if family in ("qwen3", "qwen3_moe"):
        out["qk_norm"] = True
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen's sliding window is off unless use_sliding_window is set, and then per layer.
        fields.refuse("use_sliding_window", (False, None), "per-layer sliding windows")
    else:
        window = fields.get("sliding_window", 0)
        out["sliding_window"] = window
    return out


def _moe(fields: _Fields, family: str) -> dict:
    if family == "mixtral":
        fields.refuse("router_jitter_noise", (0, 0.0, None), "router noise changes training")
        return dict(n_experts=fields.need("num_local_experts"), experts_per_token=fields.need("num_experts_per_tok"),
                    norm_topk_prob=True)
    # qwen3_moe (transformers 5 writes num_local_experts where published configs say num_experts)
    experts = fields.get("num_experts", 0) or fields.need("num_local_experts")
    dense = fields.get("mlp_only_layers", [], list)
    if any(not isinstance(layer, int) for layer in dense):
        raise UserError(f"{fields.source}: mlp_only_layers must be a list of layer numbers, got {dense!r}")
    return dict(n_experts=experts, experts_per_token=fields.need("num_experts_per_tok"),
                expert_ffn_dim=fields.need("moe_intermediate_size"), norm_topk_prob=fields.get("norm_topk_prob", False, bool),
                moe_every=fields.get("decoder_sparse_step", 1), dense_layers=tuple(sorted(dense)))


def _trainable(data: dict, source: str, family: str) -> ModelConfig:
    fields = _Fields(data, source, family)
    fields.refuse("hidden_act", ("silu", None), "phalanx's feed-forward is SwiGLU")
    fields.refuse("mlp_bias", (False, None), "feed-forward biases")
    fields.refuse("pretraining_tp", (1, None), "sliced matmuls")
    values = dict(
        name=Path(source).parent.name or Path(source).stem,
        vocab_size=fields.need("vocab_size"), n_layers=fields.need("num_hidden_layers"),
        ffn_dim=fields.need("intermediate_size"), norm_eps=fields.get("rms_norm_eps", 1e-6, float),
        max_seq_len=fields.get("max_position_embeddings", 2048),
        tie_embeddings=fields.get("tie_word_embeddings", False, bool),
        **(_deepseek(fields) if family == "deepseek_v3" else _attention(fields, family)), **_rope(fields),
    )
    if family in ("mixtral", "qwen3_moe"):
        values.update(_moe(fields, family))
        if fields.get("output_router_logits", False, bool):  # transformers adds the aux loss only then
            values["aux_loss_coef"] = fields.get("router_aux_loss_coef", 0.0, float)
    return ModelConfig(**values)


def _shape_only(data: dict, source: str, family: str) -> ModelConfig:
    """Shapes of families phalanx plans for but does not train (FLOPs to first order)."""
    fields = _Fields(data, source, family)
    name = Path(source).parent.name or Path(source).stem
    if family == "gpt2":
        dim = fields.need("n_embd")
        return ModelConfig(
            name=name, vocab_size=fields.need("vocab_size"), dim=dim, n_layers=fields.need("n_layer"),
            n_heads=fields.need("n_head"), n_kv_heads=fields.need("n_head"), ffn_dim=fields.get("n_inner", 4 * dim),
            mlp="gelu", max_seq_len=fields.get("n_positions", 1024), tie_embeddings=True,
        )
    heads = fields.need("num_attention_heads")
    common = dict(
        name=name, vocab_size=fields.need("vocab_size"), dim=fields.need("hidden_size"),
        n_layers=fields.need("num_hidden_layers"), n_heads=heads, ffn_dim=fields.need("intermediate_size"),
        max_seq_len=fields.get("max_position_embeddings", 2048),
    )
    # qwen2_moe: shared experts as whole experts
    expert = fields.need("moe_intermediate_size")
    shared = fields.get("shared_expert_intermediate_size", 0)
    if shared % expert:
        raise UserError(f"{source}: shared_expert_intermediate_size={shared} is not a multiple of "
                        f"moe_intermediate_size={expert}; phalanx models shared experts as whole experts")
    return ModelConfig(**common, n_kv_heads=fields.get("num_key_value_heads", heads),
                       n_experts=fields.need("num_experts"), experts_per_token=fields.need("num_experts_per_tok"),
                       expert_ffn_dim=expert, n_shared_experts=shared // expert,
                       norm_topk_prob=fields.get("norm_topk_prob", False, bool),
                       moe_every=fields.get("decoder_sparse_step", 1),
                       dense_layers=tuple(sorted(fields.get("mlp_only_layers", [], list))))


def from_hf_dict(data: dict, *, source: str, trainable: bool = True) -> ModelConfig:
    family = data.get("model_type")
    if family in TRAINABLE:
        return _trainable(data, source, family)
    if family in SHAPE_ONLY and not trainable:
        return _shape_only(data, source, family)
    if family in SHAPE_ONLY:
        raise UserError(f"{source}: model_type {family!r} can be planned for but not trained or loaded; "
                        f"trainable: {', '.join(TRAINABLE)}")
    if family is None:
        raise UserError(f"{source}: not a Hugging Face config.json (no 'model_type')")
    raise UserError(f"{source}: model_type {family!r} is not supported; "
                    f"supported: {', '.join(TRAINABLE)} (and for planning only: {', '.join(SHAPE_ONLY)})")
