"""Reading slices of the tensors of a Hugging Face checkpoint folder (one `model.safetensors`,
or shards listed by `model.safetensors.index.json`, or any `*.safetensors`).

Only the requested rows and columns are read (safetensors slicing maps the file and copies
just that box), so a rank that keeps a shard of a tensor never holds the whole of it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from phalanx.errors import UserError
from phalanx.model.hf_config import read_json

INDEX_FILE = "model.safetensors.index.json"

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
"""Stored dtypes phalanx reads weights from: an integer tensor would be cast to whole numbers
(int8 weights of a quantized checkpoint read as zeros and ones), a float8 one needs its scales."""


def has_weights(folder: Path) -> bool:
    return (folder / INDEX_FILE).is_file() or any(folder.glob("*.safetensors"))


def read_weight_map(index: Path) -> dict[str, str]:
    """Tensor name -> file, from a sharded checkpoint's index (safetensors or torch.save)."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{index}: no 'weight_map' of tensor names to files")
    return weight_map


def check_weight_map(index: Path, weight_map: dict[str, str], where: dict[str, str]) -> None:
    """Every tensor the index lists is in the file it names."""
    for key, name in weight_map.items():
        if where.get(key) != name:
            raise UserError(f"{index}: lists {key} in {name}, but that file does not hold it")


class SafetensorsFiles:
    """Tensor name -> file, and slices read on demand. Files are opened once each."""

    def __init__(self, folder: Path):
        # Imported when run, not at the top: it brings in safetensors, which start-up need not wait for.
        from safetensors import safe_open

        self.folder = folder
        index = folder / INDEX_FILE
        if index.is_file():
            weight_map = read_weight_map(index)
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise UserError(f"{folder}: no *.safetensors weights")
            weight_map = None
        self.handles = {}
        for name in files:
            path = folder / name
            if not path.is_file():
                raise UserError(f"{index}: lists {name}, which is not in {folder}")
            try:
                self.handles[name] = safe_open(str(path), framework="pt")
            except Exception as error:  # safetensors raises its own error types for a damaged header
                raise UserError(f"{path}: not a readable safetensors file ({error})") from None
        self.where: dict[str, str] = {}
        for name, handle in self.handles.items():
            for key in handle.keys():
                self.where[key] = name
        if weight_map is not None:
            check_weight_map(index, weight_map, self.where)

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors spells it (F32, BF16, I8, ...)."""
        return self._slice(name).get_dtype()

    def _slice(self, name: str):
        if name not in self.where:
            raise UserError(f"{self.folder}: the checkpoint has no tensor {name!r}")
        return self.handles[self.where[name]].get_slice(name)

    def read(self, name: str, expected: tuple[int, ...], index: list[torch.Tensor | None]) -> torch.Tensor:
        """Tensor `name` restricted to `index` (per dim: the rows to keep, or None for all)."""
        found = self.shape(name)
        if found != tuple(expected):
            raise UserError(f"{self.where[name]}: tensor {name!r} has shape {list(found)}, the model needs {list(expected)}")
        box, picks = [], []
        for dim, rows in enumerate(index):
            if rows is None or rows.numel() == 0:
                box.append(slice(None) if rows is None else slice(0, 0))
                picks.append(None)
                continue
            low, high = int(rows.min()), int(rows.max()) + 1
            box.append(slice(low, high))
            contiguous = rows.numel() == high - low and bool((rows == torch.arange(low, high)).all())
            picks.append(None if contiguous else rows - low)
        tensor = self._slice(name)[tuple(box)]
        for dim, pick in enumerate(picks):
            if pick is not None:
                tensor = tensor.index_select(dim, pick)
        # Each rank checks what it reads, before use (float8 has no isfinite kernel: checked widened).
        if not bool(torch.isfinite(tensor if tensor.element_size() > 1 else tensor.float()).all()):
            raise UserError(f"{self.folder}/{self.where[name]}: tensor {name!r} holds non-finite values (nan or inf)")
        return tensor
