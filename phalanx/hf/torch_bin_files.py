"""Weights saved by `torch.save` (`pytorch_model.bin`, or shards listed by
`pytorch_model.bin.index.json`), read safely: `torch.load(weights_only=True)` unpickles only
tensors and plain containers, never code, and memory-maps the file where its format allows, so
a rank that keeps a slice does not copy the whole tensor. Same interface as SafetensorsFiles.
"""

from __future__ import annotations

from pathlib import Path

import torch

from phalanx.errors import UserError
from phalanx.hf.safetensors_files import SafetensorsFiles, check_weight_map, read_weight_map

BIN_INDEX_FILE = "pytorch_model.bin.index.json"
BIN_FILE = "pytorch_model.bin"

_DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}


def has_bin_weights(folder: Path) -> bool:
    return (folder / BIN_INDEX_FILE).is_file() or (folder / BIN_FILE).is_file()


def _load(path: Path) -> dict:
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):  # the legacy (pre-zip) format cannot be memory-mapped
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except Exception as error:  # unpickling refused (code, not tensors), or a damaged file
        raise UserError(f"{path}: not a readable PyTorch weights file, or it holds more than tensors "
                        f"({str(error).splitlines()[0][:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a dict of tensor names to tensors")
    return state


class TorchBinFiles(SafetensorsFiles):
    """Tensor name -> file and slices, for torch.save weights."""

    def __init__(self, folder: Path):  # noqa: super().__init__ opens safetensors files
        self.folder = folder
        index = folder / BIN_INDEX_FILE
        if index.is_file():
            weight_map = read_weight_map(index)
            files = sorted(set(weight_map.values()))
        else:
            files, weight_map = [BIN_FILE], None
        self.tensors: dict[str, torch.Tensor] = {}
        self.where: dict[str, str] = {}
        for name in files:
            for key, tensor in _load(folder / name).items():
                self.tensors[key], self.where[key] = tensor, name
        if weight_map is not None:
            check_weight_map(index, weight_map, self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).shape)

    def dtype(self, name: str) -> str:
        dtype = self._slice(name).dtype
        return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))

    def _slice(self, name: str):
        if name not in self.where:
            raise UserError(f"{self.folder}: the checkpoint has no tensor {name!r}")
        return self.tensors[name]
