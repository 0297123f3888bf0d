"""The single-device model. Importing `phalanx.model.config` (shapes, presets) or
`phalanx.model.hf_config` needs no torch; `Transformer` is imported on first use."""

from phalanx.model.config import PRESETS, ModelConfig, model_config

__all__ = ["ModelConfig", "model_config", "PRESETS", "Transformer"]


def __getattr__(name: str):
    if name == "Transformer":
        from phalanx.model.transformer import Transformer

        return Transformer
    raise AttributeError(f"module 'phalanx.model' has no attribute {name!r}")
