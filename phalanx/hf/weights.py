"""Initial weights from a Hugging Face checkpoint folder, read slice by slice on every rank.

`CheckpointWeights` is a weight source for `phalanx.model.init.init_weights`: asked for a
parameter's rows, it reads exactly those from the safetensors files (an expert stack from the
per-expert tensors of the experts this rank holds). Before any read it checks the whole
checkpoint against the model, by name and shape only, so a missing tensor, a wrong shape or a
learned tensor the model would ignore is a one-line error, never a silent difference.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from phalanx.errors import UserError
from phalanx.hf.fp8_weights import BlockQuantized
from phalanx.hf.names import IGNORED_CHECKPOINT_TENSORS, hf_names, is_expert_stack
from phalanx.hf.safetensors_files import SafetensorsFiles
from phalanx.model.config import ModelConfig
from phalanx.model.hf_config import config_path, read_json


def checkpoint_family(folder: Path) -> str:
    return read_json(config_path(folder)).get("model_type", "")


LOADED_BUFFERS = {"deepseek_v3": ".router.expert_bias"}
"""Buffers a family's checkpoints hold (DeepSeek-V3's score-correction bias), by name ending."""


def expected_shapes(cfg: ModelConfig, family: str = "") -> dict[str, tuple[int, ...]]:
    """Canonical parameter name (and checkpointed buffer name) -> full shape, from the model
    built on the meta device."""
    from phalanx.model.init import build_model

    model = build_model(cfg)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if family in LOADED_BUFFERS:
        shapes.update({name: tuple(b.shape) for name, b in model.named_buffers() if name.endswith(LOADED_BUFFERS[family])})
    return shapes


def skipped_layers(folder: Path, cfg: ModelConfig) -> re.Pattern | None:
    """DeepSeek-V3's multi-token prediction layers (`num_nextn_predict_layers`, numbered after
    the model's own): their tensors are skipped on load (the config reader says so once)."""
    extra = read_json(config_path(folder)).get("num_nextn_predict_layers") or 0
    if not isinstance(extra, int) or extra < 1:
        return None
    numbers = "|".join(str(cfg.n_layers + i) for i in range(extra))
    return re.compile(rf"model\.layers\.({numbers})\..*")


class CheckpointWeights:
    """Reads phalanx parameters from the checkpoint in `folder` (its config's family)."""

    def __init__(self, folder: str | Path, cfg: ModelConfig):
        self.folder = Path(folder)
        self.cfg, self.family = cfg, checkpoint_family(self.folder)
        self.files = SafetensorsFiles(self.folder)
        self.fp8 = BlockQuantized.of(self.folder, self.files)
        self.skipped = skipped_layers(self.folder, cfg)
        self._check(expected_shapes(cfg, self.family))

    def _names(self, name: str) -> list[str]:
        return hf_names(name, self.family, self.cfg.n_experts)

    def _check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        wanted: set[str] = set()
        for name, shape in shapes.items():
            per_tensor = shape[1:] if is_expert_stack(name) else shape
            for hf_name in self._names(name):
                wanted.add(hf_name)
                if hf_name not in self.files.where:
                    raise UserError(f"{self.folder}: the checkpoint has no tensor {hf_name!r} (for {name})")
                found = self.files.shape(hf_name)
                if found != tuple(per_tensor):
                    raise UserError(f"{self.folder}/{self.files.where[hf_name]}: tensor {hf_name!r} has shape "
                                    f"{list(found)}, the model needs {list(per_tensor)}")
        if self.fp8 is not None:
            wanted |= self.fp8.scales_of(wanted)
        unused = sorted(n for n in self.files.names() - wanted if not IGNORED_CHECKPOINT_TENSORS.match(n)
                        and not (self.skipped and self.skipped.fullmatch(n)))
        if self.cfg.tie_embeddings and unused == ["lm_head.weight"]:
            unused = []  # some tied checkpoints store the shared matrix twice
        if unused:
            more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
            raise UserError(f"{self.folder}: tensor {unused[0]!r}{more} would be ignored by the model; "
                            "the checkpoint does not match its config.json")

    def _read(self, name: str, shape: tuple[int, ...], index: list[torch.Tensor | None]) -> torch.Tensor:
        if self.fp8 is not None and self.fp8.is_quantized(name):
            return self.fp8.read(name, shape, index)
        return self.files.read(name, shape, index)

    def read(self, name: str, shape: torch.Size, index: list[torch.Tensor | None]) -> torch.Tensor:
        names = self._names(name)
        if not is_expert_stack(name):
            return self._read(names[0], tuple(shape), index)
        experts = index[0] if index[0] is not None else torch.arange(shape[0])
        rows = [self._read(names[int(e)], tuple(shape[1:]), index[1:]) for e in experts]
        return torch.stack(rows) if rows else torch.empty(0, *shape[1:])

    def read_buffer(self, name: str) -> torch.Tensor | None:
        """A checkpointed buffer's value (`fill_weights` asks after the parameters), else None."""
        ending = LOADED_BUFFERS.get(self.family)
        if ending is None or not name.endswith(ending):
            return None
        hf_name = self._names(name)[0]
        return self.files.read(hf_name, self.files.shape(hf_name), [None])


def initial_weights(model: str, init: str, cfg: ModelConfig) -> CheckpointWeights | None:
    """Where training's initial weights come from: the model directory's checkpoint with
    `init="auto"` when it has one (checked against the model now), else None (the seed)."""
    from phalanx.hf.safetensors_files import has_weights
    from phalanx.model.hf_config import model_directory

    folder = model_directory(model)
    if init == "random" or folder is None or not has_weights(folder):
        return None
    return CheckpointWeights(folder, cfg)
