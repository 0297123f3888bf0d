"""A `--model` value resolved: a preset's name, or a Hugging Face directory or config.json
(torch-free)."""

from __future__ import annotations

from phalanx.errors import UserError
from phalanx.model.config import PRESETS, ModelConfig
from phalanx.model.hf_config import is_model_path, read_model_config


def model_config(name: str) -> ModelConfig:
    """The preset called `name`, or the model a Hugging Face directory or config.json describes
    (`phalanx.model.hf_config`); else a UserError listing the valid names."""
    if name in PRESETS:
        return PRESETS[name]
    if is_model_path(name):
        return read_model_config(name)
    raise UserError(f"unknown model {name!r}; choose one of: {', '.join(PRESETS)}, "
                    "or a Hugging Face model directory or config.json")
