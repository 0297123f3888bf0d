from phalanx.model.config import ModelConfig, model_config, PRESETS
from phalanx.model.transformer import Transformer

__all__ = ["ModelConfig", "model_config", "PRESETS", "Transformer"]
