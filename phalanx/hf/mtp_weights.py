"""DeepSeek-V3's multi-token-prediction layer from its checkpoint, for speculative decoding.

The main model skips the layer on load (`weights.skipped_layers`); `phalanx serve
--speculative-config '{"method": "deepseek_mtp", ...}'` reads it here into a
`model.multi_token_prediction.MultiTokenPrediction`. Its tensors are model.layers.{N}.*, N the
model's layer count: enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, and a decoder
layer under the names any layer N has (`names.hf_names`); its embed_tokens copy is not read
(the main model's embedding is shared). Checked first, by name and shape, so a checkpoint that
lacks a tensor is a one-line error before any is read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from phalanx.errors import UserError
from phalanx.hf.fp8_weights import BlockQuantized
from phalanx.hf.names import hf_names, is_expert_stack
from phalanx.hf.weights import checkpoint_family, weight_files
from phalanx.model.config import ModelConfig
from phalanx.model.hf_config import config_path, read_json
from phalanx.model.init import fill_weights
from phalanx.model.multi_token_prediction import MultiTokenPrediction, build_multi_token_prediction

FAMILY = "deepseek_v3"


def mtp_layers(folder: Path | None, is_run: bool = False) -> int:
    """The checkpoint's multi-token-prediction layers, or a UserError saying why it has none
    that phalanx reads (not a DeepSeek-V3 checkpoint, or num_nextn_predict_layers 0)."""
    if is_run or folder is None:
        raise UserError("--speculative-config deepseek_mtp needs a Hugging Face DeepSeek-V3 checkpoint with its "
                        "multi-token-prediction layer; a phalanx training run has none")
    family = checkpoint_family(folder)
    if family != FAMILY:
        raise UserError(f"--speculative-config deepseek_mtp is for DeepSeek-V3-family checkpoints; {folder} is "
                        f"{family or 'of no model_type'!s}")
    count = read_json(config_path(folder)).get("num_nextn_predict_layers") or 0
    if not isinstance(count, int) or count < 1:
        raise UserError(f"--speculative-config deepseek_mtp: {folder} has no multi-token-prediction layer "
                        f"(num_nextn_predict_layers {count})")
    return count


class MtpWeights:
    """Reads a `MultiTokenPrediction`'s parameters (and its router's bias) from layer `layer`
    of the checkpoint in `folder`."""

    def __init__(self, folder: Path, cfg: ModelConfig, layer: int):
        self.folder, self.cfg, self.layer = folder, cfg, layer
        self.files = weight_files(folder)
        self.fp8 = BlockQuantized.of(folder, self.files)

    def names(self, name: str) -> list[str]:
        """The checkpoint tensor(s) of the module's parameter (or buffer) `name`."""
        if name.startswith("block."):
            return hf_names(f"layers.{self.layer}.{name.removeprefix('block.')}", FAMILY, self.cfg.n_experts)
        return [f"model.layers.{self.layer}.{name}"]

    def check(self, module: MultiTokenPrediction) -> None:
        """Every tensor the module reads is there with its shape (else one line naming it)."""
        wanted = {name: tuple(p.shape) for name, p in module.named_parameters()}
        wanted |= {name: tuple(b.shape) for name, b in module.named_buffers() if name.endswith(".router.expert_bias")}
        for name, shape in wanted.items():
            per_tensor = shape[1:] if is_expert_stack(name) else shape
            for hf_name in self.names(name):
                if hf_name not in self.files.where:
                    raise UserError(f"{self.folder}: the checkpoint has no tensor {hf_name!r} (the multi-token-"
                                    f"prediction layer's {name})")
                if (found := self.files.shape(hf_name)) != per_tensor:
                    raise UserError(f"{self.folder}/{self.files.where[hf_name]}: tensor {hf_name!r} has shape "
                                    f"{list(found)}, the multi-token-prediction layer needs {list(per_tensor)}")

    def _read(self, name: str, shape: tuple[int, ...], index: list[torch.Tensor | None]) -> torch.Tensor:
        if self.fp8 is not None and self.fp8.is_quantized(name):
            return self.fp8.read(name, shape, index)
        return self.files.read(name, shape, index)

    def read(self, name: str, shape: torch.Size, index: list[torch.Tensor | None]) -> torch.Tensor:
        names = self.names(name)
        if not is_expert_stack(name):
            return self._read(names[0], tuple(shape), index)
        experts = index[0] if index[0] is not None else torch.arange(shape[0])
        return torch.stack([self._read(names[int(e)], tuple(shape[1:]), index[1:]) for e in experts])

    def read_buffer(self, name: str) -> torch.Tensor | None:
        if not name.endswith(".router.expert_bias"):
            return None
        hf_name = self.names(name)[0]
        return self.files.read(hf_name, self.files.shape(hf_name), [None])


def load_multi_token_prediction(folder: Path, cfg: ModelConfig, device, dtype) -> MultiTokenPrediction:
    """The checkpoint's first multi-token-prediction layer (layer n_layers), on `device` in `dtype`."""
    mtp_layers(folder)
    module = build_multi_token_prediction(cfg, cfg.n_layers)
    weights = MtpWeights(folder, cfg, cfg.n_layers)
    weights.check(module)
    return fill_weights(module, device, weights).to(dtype).eval()
