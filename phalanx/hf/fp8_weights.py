"""FP8 block-quantized checkpoints (DeepSeek-V3/R1 as published): dequantized on load.

Such a checkpoint's config.json has `quantization_config` = {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}; each quantized matrix W (float8_e4m3fn) comes with
`W_scale_inv` (fp32, one value per 128 x 128 block, the last blocks partial), and the real
weight is W * scale_inv blockwise. phalanx trains and generates in fp32/bf16, so each matrix
is dequantized as it is read (the whole matrix, then this rank's rows of it: a rank briefly
holds one full matrix, never the whole checkpoint). Tensors without a scale (norms, the
router, embeddings) are stored unquantized and read as they are.
"""

from __future__ import annotations

from pathlib import Path

import torch

from phalanx.errors import UserError
from phalanx.model.hf_config import config_path, read_json

SCALE_SUFFIX = "_scale_inv"


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight (rows, cols) of fp8 times its per-block scales (ceil(rows/b0), ceil(cols/b1)) -> fp32."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale  # (rows, cols)


class BlockQuantized:
    """How to read a block-quantized checkpoint's matrices."""

    def __init__(self, files, block: tuple[int, int]):
        self.files, self.block = files, block

    @classmethod
    def of(cls, folder: Path, files) -> "BlockQuantized | None":
        """The reader for `folder`'s quantization, None when it has none; any other
        quantization is a one-line error (its numbers cannot be read as they are)."""
        config = read_json(config_path(folder)).get("quantization_config")
        if not config:
            return None
        method = config.get("quant_method") if isinstance(config, dict) else config
        block = config.get("weight_block_size") if isinstance(config, dict) else None
        if method != "fp8" or not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise UserError(f"{folder}: quantization_config {config!r} is not supported (phalanx dequantizes "
                            "fp8 with a weight_block_size of two block sides on load)")
        return cls(files, (block[0], block[1]))

    def is_quantized(self, name: str) -> bool:
        return name + SCALE_SUFFIX in self.files.where

    def scales_of(self, names: set[str]) -> set[str]:
        """The scale tensors that belong to `names` (read with them, not ignored)."""
        return {name + SCALE_SUFFIX for name in names if self.is_quantized(name)}

    def read(self, name: str, shape: tuple[int, ...], index: list[torch.Tensor | None]) -> torch.Tensor:
        """Matrix `name` dequantized to fp32, restricted to `index` (per dim: the rows to keep)."""
        scale_name = name + SCALE_SUFFIX
        if len(shape) != 2:
            raise UserError(f"{self.files.folder}: quantized tensor {name!r} has shape {list(shape)}; only matrices are dequantized")
        full = self.files.read(name, shape, [None, None])
        expected = tuple(-(-side // block) for side, block in zip(shape, self.block))
        scale = self.files.read(scale_name, self.files.shape(scale_name), [None, None])
        if tuple(scale.shape) != expected:
            raise UserError(f"{self.files.folder}: {scale_name!r} has shape {list(scale.shape)}, but {list(shape)} in "
                            f"blocks of {list(self.block)} needs {list(expected)}")
        value = dequantize(full, scale, self.block)
        for dim, rows in enumerate(index):
            if rows is not None:
                value = value.index_select(dim, rows)
        return value
