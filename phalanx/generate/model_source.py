"""What `phalanx generate --model` names, and how each rank gets its part of that model.

- A Hugging Face model directory (config.json and safetensors weights): each rank reads only
  the slices it keeps (`phalanx.hf.weights.CheckpointWeights`).
- A run directory of `phalanx train` (it has a `checkpoints/` folder): the newest checkpoint,
  or `--step`; each rank loads its shards from the DCP checkpoint, which reshards on load, so
  a run trained in any layout generates in any other.

Also the text seam: how prompt text becomes ids and new ids become text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from phalanx.errors import UserError
from phalanx.model.config import ModelConfig


@dataclass(frozen=True)
class ModelSource:
    cfg: ModelConfig
    weights_dir: Path
    """The Hugging Face directory, or the checkpoint folder of a run."""
    is_run: bool
    tokenizer_dir: Path | None
    """Where a tokenizer.json may be: the model directory (of a run: the one it trained from)."""
    tokenizer: str = ""
    """A run's --tokenizer setting, if it had one."""


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / "checkpoints").is_dir()


def resolve_model(arg: str, step: int | None = None) -> ModelSource:
    """The model `--model` names, checked before any weights are read or workers started."""
    from phalanx.model.config import PRESETS
    from phalanx.model.hf_config import config_path, model_directory, read_model_config

    if is_run_dir(arg):
        from phalanx.hf.export_run import find_checkpoint

        path, meta = find_checkpoint(Path(arg), step)
        train = meta.get("train", {})
        try:
            tokenizer_dir = model_directory(train.get("model", ""))
        except UserError:
            tokenizer_dir = None  # the model directory has moved since the run
        return ModelSource(ModelConfig.from_dict(meta["model"]), path, True, tokenizer_dir, train.get("tokenizer", ""))
    if step is not None:
        raise UserError(f"--step is for run directories (with a checkpoints/ folder); {arg!r} is not one")
    if arg in PRESETS:
        raise UserError(f"{arg!r} is a preset without weights; pass a Hugging Face model directory or a run directory")
    from phalanx.hf.safetensors_files import has_weights

    folder = config_path(arg).parent
    if Path(arg).is_file() or not has_weights(folder):
        raise UserError(f"{arg}: no *.safetensors weights to generate with (a model directory or a run directory is needed)")
    return ModelSource(read_model_config(arg), folder, False, folder)


def load_model(source: ModelSource, mesh):
    """This rank's part of the model in the mesh's layout, with the source's weights."""
    from phalanx.parallel.apply import parallelize

    weights = None
    if not source.is_run:
        from phalanx.hf.weights import CheckpointWeights

        weights = CheckpointWeights(source.weights_dir, source.cfg)
    model = parallelize(source.cfg, mesh, seed=0, weights=weights)
    if source.is_run:
        _load_run_checkpoint(model, source)
    return model.eval()


def _load_run_checkpoint(model, source: ModelSource) -> None:
    """The model part of a training checkpoint (its optimizer state is not read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    import phalanx.train.checkpoint  # noqa: F401  (quiets DCP's one-process warning)
    from phalanx.parallel.expert_checkpoint import globalize_experts

    state = get_model_state_dict(model)
    if source.cfg.tie_embeddings:
        state.pop("output.weight", None)  # the embedding's matrix, loaded once under its own name
    wrapped, restore = globalize_experts(model, {"model": state, "optim": {}})  # all ep ranks' experts
    dcp.load({"model": wrapped["model"]}, checkpoint_id=str(source.weights_dir))
    set_model_state_dict(model, restore()["model"], options=StateDictOptions(strict=False))


@dataclass(frozen=True)
class TextCodec:
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int | None
    """Generation stops after this id; None: the tokenizer has no end-of-text token (bytes)."""


def text_codec(model_dir: Path | None, tokenizer: str = "") -> TextCodec:
    """Prompt text <-> ids: `tokenizer` ("bytes", or a tokenizer.json or its folder), else the
    model directory's tokenizer.json, else bytes.

    The one place that knows tokenizers: at the merge with the tokenizer work, this becomes a
    call of `phalanx.data.tokenizer.load_tokenizer(tokenizer, model_dir)`."""
    from phalanx.data import tokenizer as byte_tokenizer

    if tokenizer == "bytes":
        path = None
    elif tokenizer:
        path = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
        if not path.is_file():
            raise UserError(f"--tokenizer {tokenizer!r}: no such tokenizer.json")
    else:
        path = model_dir / "tokenizer.json" if model_dir is not None and (model_dir / "tokenizer.json").is_file() else None
    if path is None:
        return TextCodec(lambda text: [int(t) for t in byte_tokenizer.encode(text)], byte_tokenizer.decode, None)
    from tokenizers import Tokenizer

    loaded = Tokenizer.from_file(str(path))
    return TextCodec(lambda text: loaded.encode(text).ids, loaded.decode, _eos_id(loaded, path.parent))


def _eos_id(loaded, folder: Path) -> int | None:
    """The end-of-text id that tokenizer_config.json names (tokenizer.json alone does not say)."""
    import json

    try:
        eos = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return loaded.token_to_id(eos) if isinstance(eos, str) else None
