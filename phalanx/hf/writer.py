"""Writing a phalanx model as a Hugging Face directory: config.json and sharded safetensors.

Expert stacks are split into one tensor per expert under the family's names; shards are
named `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` when there is
more than one (one `model.safetensors` otherwise), as `save_pretrained` writes them. The
directory is written beside its final place and renamed into it, so an error leaves nothing
half written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from phalanx.errors import UserError
from phalanx.hf.hf_export_config import export_family, hf_config_dict
from phalanx.hf.names import hf_names, is_expert_stack
from phalanx.hf.safetensors_files import INDEX_FILE
from phalanx.model.config import ModelConfig
from phalanx.model.init import canonical_name

DEFAULT_SHARD_BYTES = 5 * 2**30
"""Largest shard file: 5 GiB, transformers 4's default `max_shard_size` (5 adds little file
count over 50 and keeps each file small enough for hub uploads and partial downloads)."""


def hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig, family: str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors from a full phalanx state dict (canonical names, whole tensors)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        name = canonical_name(name)
        if name.endswith("router.expert_bias") and family != "deepseek_v3":  # deepseek_v3: its score-correction bias
            if torch.count_nonzero(tensor):  # learned, then frozen by router_bias_rate=0
                raise UserError(f"cannot export {cfg.name!r}: {name} is not zero (a learned balancing bias "
                                "steers which experts are chosen; the exported families have no such bias)")
            continue
        if cfg.tie_embeddings and name == "output.weight":
            continue  # the embedding's weight; tied checkpoints store it once
        targets = hf_names(name, family, cfg.n_experts)
        parts = list(tensor) if is_expert_stack(name) else [tensor]
        for target, part in zip(targets, parts, strict=True):
            out[target] = part.detach().to("cpu").contiguous()
    return out


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def write_hf_directory(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, *,
                       tokenizer_files: list[Path] = (), bos_id: int | None = None, eos_id: int | None = None,
                       max_shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: torch.dtype | None = None,
                       generation_eos_ids: list[int] = ()) -> Path:
    """Write config.json, the weights and the tokenizer files to `out_dir` (must not exist
    or be empty); with `generation_eos_ids`, generation_config.json naming them (an int for
    one, a list for several, as Hugging Face checkpoints write it)."""
    # Imported when run, not at the top: it brings in safetensors, which start-up need not wait for.
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not an empty folder")
    family = export_family(cfg)
    tensors = hf_state_dict(state, cfg, family)
    if dtype is not None:
        tensors = {name: t.to(dtype) for name, t in tensors.items()}
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        config = hf_config_dict(cfg, family, bos_id=bos_id, eos_id=eos_id)
        if dtype is not None:
            config["dtype"] = str(dtype).removeprefix("torch.")
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if generation_eos_ids:
            ids = list(generation_eos_ids)
            generation = {"eos_token_id": ids[0] if len(ids) == 1 else ids}
            (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        shards = _shards(tensors, max_shard_bytes)
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(staging / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (staging / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                         indent=2) + "\n")
        for file in tokenizer_files:
            shutil.copy2(file, staging / Path(file).name)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def save(model: nn.Module, path: str | Path, **options) -> Path:
    """Write a single-process phalanx model (`phalanx.hf.load`'s or one built from a config)
    as a Hugging Face directory."""
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        raise UserError("save() takes a phalanx Transformer (it reads the model's cfg)")
    return write_hf_directory(model.state_dict(), cfg, path, **options)
