"""Initial weights from a Hugging Face checkpoint folder, read slice by slice on every rank.

`CheckpointWeights` is a weight source for `phalanx.model.init.init_weights`: asked for a
parameter's rows, it reads exactly those from the safetensors files (an expert stack from the
per-expert tensors of the experts this rank holds). Before any read it checks the whole
checkpoint against the model, by name and shape only, so a missing tensor, a wrong shape or a
learned tensor the model would ignore is a one-line error, never a silent difference.
"""

from __future__ import annotations

from pathlib import Path

import torch

from phalanx.errors import UserError
from phalanx.hf.names import IGNORED_CHECKPOINT_TENSORS, hf_names, is_expert_stack
from phalanx.hf.safetensors_files import SafetensorsFiles
from phalanx.model.config import ModelConfig
from phalanx.model.hf_config import config_path, read_json


def checkpoint_family(folder: Path) -> str:
    return read_json(config_path(folder)).get("model_type", "")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical parameter name -> full shape, from the model built on the meta device."""
    from phalanx.model.init import build_model

    return {name: tuple(p.shape) for name, p in build_model(cfg).named_parameters()}


class CheckpointWeights:
    """Reads phalanx parameters from the checkpoint in `folder` (its config's family)."""

    def __init__(self, folder: str | Path, cfg: ModelConfig):
        self.folder = Path(folder)
        self.cfg, self.family = cfg, checkpoint_family(self.folder)
        self.files = SafetensorsFiles(self.folder)
        self._check(expected_shapes(cfg))

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
        unused = sorted(n for n in self.files.names() - wanted if not IGNORED_CHECKPOINT_TENSORS.match(n))
        if self.cfg.tie_embeddings and unused == ["lm_head.weight"]:
            unused = []  # some tied checkpoints store the shared matrix twice
        if unused:
            more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
            raise UserError(f"{self.folder}: tensor {unused[0]!r}{more} would be ignored by the model; "
                            "the checkpoint does not match its config.json")

    def read(self, name: str, shape: torch.Size, index: list[torch.Tensor | None]) -> torch.Tensor:
        names = self._names(name)
        if not is_expert_stack(name):
            return self.files.read(names[0], tuple(shape), index)
        experts = index[0] if index[0] is not None else torch.arange(shape[0])
        rows = [self.files.read(names[int(e)], tuple(shape[1:]), index[1:]) for e in experts]
        return torch.stack(rows) if rows else torch.empty(0, *shape[1:])


def initial_weights(model: str, init: str, cfg: ModelConfig) -> CheckpointWeights | None:
    """Where training's initial weights come from: the model directory's checkpoint with
    `init="auto"` when it has one (checked against the model now), else None (the seed)."""
    from phalanx.hf.safetensors_files import has_weights
    from phalanx.model.hf_config import model_directory

    folder = model_directory(model)
    if init == "random" or folder is None or not has_weights(folder):
        return None
    return CheckpointWeights(folder, cfg)
