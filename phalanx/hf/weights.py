"""Initial weights from a Hugging Face checkpoint folder, read slice by slice on every rank.

`CheckpointWeights` is a weight source for `phalanx.model.init.init_weights`: asked for a
parameter's rows, it reads exactly those from the safetensors files (an expert stack from the
per-expert tensors of the experts this rank holds). Before any read it checks the whole
checkpoint against the model, by name, shape and dtype, so a missing tensor, a wrong shape, an
integer tensor where floats are needed or a learned tensor the model would ignore is a
one-line error, never a silent difference; each slice read is checked finite before use.

This is the one model-directory reader (training, `phalanx generate`, `phalanx.hf.load`):
safetensors weights, else `pytorch_model.bin` read with `torch.load(weights_only=True)`
(torch_bin_files.py), else a refusal saying so. Random initialization happens only when asked
for: `--init random`, a preset, or a bare config.json (no weights beside it).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from phalanx.errors import UserError
from phalanx.hf.fp8_weights import BlockQuantized
from phalanx.hf.names import IGNORED_CHECKPOINT_TENSORS, hf_names, is_expert_stack
from phalanx.hf.safetensors_files import FLOAT_DTYPES, SafetensorsFiles, has_weights
from phalanx.hf.torch_bin_files import TorchBinFiles, has_bin_weights
from phalanx.model.config import ModelConfig
from phalanx.model.hf_config import config_path, model_directory, read_json
from phalanx.model.init import build_model


def checkpoint_family(folder: Path) -> str:
    return read_json(config_path(folder)).get("model_type", "")


LOADED_BUFFERS = {"deepseek_v3": ".router.expert_bias"}
"""Buffers a family's checkpoints hold (DeepSeek-V3's score-correction bias), by name ending."""


def expected_shapes(cfg: ModelConfig, family: str = "") -> dict[str, tuple[int, ...]]:
    """Canonical parameter name (and checkpointed buffer name) -> full shape, from the model
    built on the meta device."""
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
        self.files = weight_files(self.folder)
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
                quantized = self.fp8 is not None and self.fp8.is_quantized(hf_name)  # read with its scales
                if not quantized and (dtype := self.files.dtype(hf_name)) not in FLOAT_DTYPES:
                    raise UserError(f"{self.folder}/{self.files.where[hf_name]}: tensor {hf_name!r} is stored as {dtype}; "
                                    f"the model needs floating-point weights ({', '.join(FLOAT_DTYPES)}): a quantized "
                                    "checkpoint must be dequantized first")
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


def weight_files(folder: Path) -> SafetensorsFiles:
    """The weight files of a model directory: safetensors, else torch.save files read safely;
    a UserError saying what is there when neither is."""
    if has_weights(folder):
        return SafetensorsFiles(folder)
    if has_bin_weights(folder):
        return TorchBinFiles(folder)
    raise UserError(no_weights_reason(folder))


def has_any_weights(folder: Path) -> bool:
    return has_weights(folder) or has_bin_weights(folder)


def no_weights_reason(folder: Path) -> str:
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack"))
    if others:
        return (f"{folder} has no *.safetensors or pytorch_model.bin weights (found {', '.join(others[:3])}, "
                "which phalanx does not read)")
    return f"{folder} has no weights (*.safetensors or pytorch_model.bin)"


def initial_weights(model: str, init: str, cfg: ModelConfig) -> CheckpointWeights | None:
    """Where training's initial weights come from: the model directory's checkpoint with
    `init="auto"` (checked against the model now), or None (random, from the seed) when asked
    for: `init="random"`, a preset, or a config.json file with no weights beside it. A model
    directory without weights is refused rather than silently trained from random weights."""
    folder = model_directory(model)
    if init == "random" or folder is None:
        return None
    if has_any_weights(folder):
        return CheckpointWeights(folder, cfg)
    if Path(model).expanduser().is_file():
        return None  # a bare config.json: its shape, from random weights (said in the start line)
    raise UserError(f"{no_weights_reason(folder)}; pass --init random to train it from random weights")
