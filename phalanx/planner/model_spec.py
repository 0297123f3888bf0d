"""Model description for the planner: a preset name, a project JSON file, or a HF config.json.

Project JSON uses ModelConfig's own field names (n_layers, dim, n_heads, n_kv_heads, ffn_dim,
mlp, vocab_size, n_experts, experts_per_token, expert_ffn_dim, n_shared_experts,
n_dense_layers, ...). A file with a `model_type` key is read as a Hugging Face config of the
Llama, Mixtral, Qwen-MoE, DeepSeek-V3 or GPT-2 families.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from phalanx.errors import UserError
from phalanx.model.config import PRESETS, ModelConfig

_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}


def model_from_dict(data: dict, *, source: str) -> ModelConfig:
    """Project keys or a Hugging Face config, told apart by `model_type`."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a JSON object, got {type(data).__name__}")
    if "model_type" in data:
        return _from_hf(data, source=source)
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise UserError(f"{source}: unknown model key {unknown[0]!r}; valid keys: {', '.join(_FIELDS)}")
    values = {}
    for key, raw in data.items():
        kind = type(_FIELDS[key].default)
        if kind in (int, float) and (isinstance(raw, bool) or not isinstance(raw, (int, float))):
            raise UserError(f"{source}: {key} must be a number, got {raw!r}")
        if kind is int and raw != int(raw):
            raise UserError(f"{source}: {key} must be an integer, got {raw!r}")
        values[key] = kind(raw) if kind in (int, float) else raw
    values.setdefault("name", Path(source).stem)
    return ModelConfig(**values)


def _need(data: dict, key: str, source: str, family: str):
    if key not in data or data[key] is None:
        raise UserError(f"{source}: {family} config.json has no {key!r}")
    return data[key]


def _from_hf(data: dict, *, source: str) -> ModelConfig:
    kind = data["model_type"]
    name = Path(source).parent.name or Path(source).stem
    if kind == "gpt2":
        dim = _need(data, "n_embd", source, kind)
        return ModelConfig(
            name=name, vocab_size=_need(data, "vocab_size", source, kind), dim=dim,
            n_layers=_need(data, "n_layer", source, kind), n_heads=_need(data, "n_head", source, kind),
            n_kv_heads=_need(data, "n_head", source, kind), ffn_dim=data.get("n_inner") or 4 * dim,
            mlp="gelu", max_seq_len=data.get("n_positions", 1024), tie_embeddings=True,
        )
    if kind not in ("llama", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        raise UserError(
            f"{source}: model_type {kind!r} is not supported; "
            "supported: llama, mistral, mixtral, qwen2_moe, qwen3_moe, deepseek_v3, gpt2"
        )
    heads = _need(data, "num_attention_heads", source, kind)
    common = dict(
        name=name, vocab_size=_need(data, "vocab_size", source, kind),
        dim=_need(data, "hidden_size", source, kind), n_layers=_need(data, "num_hidden_layers", source, kind),
        n_heads=heads, n_kv_heads=data.get("num_key_value_heads") or heads,
        ffn_dim=_need(data, "intermediate_size", source, kind), rope_theta=float(data.get("rope_theta", 10000.0)),
        norm_eps=float(data.get("rms_norm_eps", 1e-5)), max_seq_len=data.get("max_position_embeddings", 2048),
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
    )
    if kind == "mixtral":
        return ModelConfig(**common, n_experts=_need(data, "num_local_experts", source, kind),
                           experts_per_token=_need(data, "num_experts_per_tok", source, kind))
    if kind in ("qwen2_moe", "qwen3_moe"):
        expert = _need(data, "moe_intermediate_size", source, kind)
        shared = data.get("shared_expert_intermediate_size") or 0
        if shared % expert:
            raise UserError(f"{source}: shared_expert_intermediate_size={shared} is not a multiple of "
                            f"moe_intermediate_size={expert}; phalanx models shared experts as whole experts")
        if data.get("decoder_sparse_step", 1) != 1:
            raise UserError(f"{source}: decoder_sparse_step={data['decoder_sparse_step']} (MoE every few layers) is not supported")
        dense = sorted(data.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise UserError(f"{source}: mlp_only_layers={dense} must be the first layers (0, 1, ...)")
        return ModelConfig(**common, n_experts=_need(data, "num_experts", source, kind),
                           experts_per_token=_need(data, "num_experts_per_tok", source, kind),
                           expert_ffn_dim=expert, n_shared_experts=shared // expert, n_dense_layers=len(dense))
    if kind == "deepseek_v3":
        # Multi-head latent attention is modelled as plain attention with the same head count.
        return ModelConfig(**{**common, "n_kv_heads": heads},
                           n_experts=_need(data, "n_routed_experts", source, kind),
                           experts_per_token=_need(data, "num_experts_per_tok", source, kind),
                           expert_ffn_dim=_need(data, "moe_intermediate_size", source, kind),
                           n_shared_experts=data.get("n_shared_experts") or 0,
                           n_dense_layers=data.get("first_k_dense_replace", 0))
    return ModelConfig(**common)


def load_model_file(path: str | Path) -> ModelConfig:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read model file {str(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"model file {str(path)!r} is not valid JSON: {exc}") from None
    return model_from_dict(data, source=str(path))


def model_from_name(name: str) -> ModelConfig:
    """A preset name or a path to a JSON file."""
    if name in PRESETS:
        return PRESETS[name]
    if Path(name).suffix == ".json" or Path(name).exists():
        return load_model_file(name)
    raise UserError(f"unknown model {name!r}; choose a .json file or one of: {', '.join(PRESETS)}")
