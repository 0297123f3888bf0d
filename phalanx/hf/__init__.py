"""Hugging Face models in and out: `load(path)` builds a phalanx model from a model directory
(config.json + safetensors, or pytorch_model.bin read with weights_only), `save(model, path)` writes one that `transformers` loads.

Importing this package needs no torch; `load` and `save` import it when called.
"""

from __future__ import annotations

from pathlib import Path

from phalanx.model.hf_config import config_path, read_model_config

__all__ = ["load", "save"]


def load(path: str | Path, dtype=None):
    """A phalanx Transformer (one process, CPU) with the directory's weights, in `dtype`
    (default torch.float32): `forward(tokens[B, S]) -> logits[B, S, V]`."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch

    from phalanx.hf.weights import CheckpointWeights
    from phalanx.model.init import build_model, init_weights

    cfg = read_model_config(path)
    folder = config_path(path).parent  # CheckpointWeights refuses a folder without weights, saying why
    model = init_weights(build_model(cfg), cfg, seed=0, device="cpu", source=CheckpointWeights(folder, cfg))
    return model.to(dtype or torch.float32).eval()


def save(model, path: str | Path, **options) -> Path:
    """Write `model` (one process) as a Hugging Face directory; see `phalanx.hf.writer.save`."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.hf.writer import save as save_model

    return save_model(model, path, **options)
