"""Checkpoints: DCP saving and loading (`store.py`), the background writer (`writer.py`), the
manifest of a checkpoint's files (`manifest.py`) and the one reader that picks an intact one
(`reader.py`). Below `train/` (which writes them), `hf/` (export) and `inference/` (generate,
serve), which all read them the same way."""
