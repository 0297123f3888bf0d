"""Model description for the planner: a preset name, a project JSON file, or a HF config.json.

Project JSON uses ModelConfig's own field names (n_layers, dim, n_heads, n_kv_heads, ffn_dim,
mlp, vocab_size, n_experts, experts_per_token, expert_ffn_dim, n_shared_experts,
n_dense_layers, ...). A file with a `model_type` key is read as a Hugging Face config by
`phalanx.model.hf_config` (the reader training and export use); a model directory stands for
its config.json.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from phalanx.errors import UserError
from phalanx.model.config import PRESETS, ModelConfig
from phalanx.model.hf_config import config_path, from_hf_dict

_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}
SHAPE_KEYS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
"""What a project model file must give: ModelConfig's defaults are a toy model's, and planning
a large model with a few of them left in would be silently wrong."""


def model_from_dict(data: dict, *, source: str) -> ModelConfig:
    """Project keys or a Hugging Face config, told apart by `model_type`."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a JSON object, got {type(data).__name__}")
    if "model_type" in data:  # the reader training and export use, plus shape-only families
        return from_hf_dict(data, source=source, trainable=False)
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
    missing = [key for key in SHAPE_KEYS if key not in data]
    if missing:
        raise UserError(f"{source}: missing model key{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                        f"(a project model file gives the whole shape: {', '.join(SHAPE_KEYS)})")
    values.setdefault("name", Path(source).stem)
    return ModelConfig(**values)


def load_model_file(path: str | Path) -> ModelConfig:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read model file {str(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"model file {str(path)!r} is not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"model file {str(path)!r} is not text (a binary file?); expected JSON") from None
    return model_from_dict(data, source=str(path))


def model_from_name(name: str) -> ModelConfig:
    """A preset name, a path to a JSON file, or a Hugging Face model directory."""
    if name in PRESETS:
        return PRESETS[name]
    if Path(name).is_dir():
        return load_model_file(config_path(name))
    if Path(name).suffix == ".json" or Path(name).exists():
        return load_model_file(name)
    raise UserError(f"unknown model {name!r}; choose a .json file or one of: {', '.join(PRESETS)}")
