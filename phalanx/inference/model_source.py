"""What `phalanx generate --model` names, and how each rank gets its part of that model.

- A Hugging Face model directory (config.json and safetensors or pytorch_model.bin weights): each rank reads only
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

from phalanx.checkpoint.reader import read_run_checkpoint
from phalanx.errors import UserError
from phalanx.inference.generation_config import checkpoint_eos_ids
from phalanx.model.config import PRESETS, ModelConfig
from phalanx.model.hf_config import config_path, model_directory, read_model_config


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
    step: int | None = None
    """Of a run: the step of the checkpoint read."""


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / "checkpoints").is_dir()


def resolve_model(arg: str, step: int | None = None) -> ModelSource:
    """The model `--model` names, checked before any weights are read or workers started."""
    if is_run_dir(arg):

        found = read_run_checkpoint(arg, step)
        train = found.meta.get("train", {})
        try:
            tokenizer_dir = model_directory(train.get("model", ""))
        except UserError:
            tokenizer_dir = None  # the model directory has moved since the run
        return ModelSource(found.model_config(), found.path, True, tokenizer_dir, train.get("tokenizer", ""), found.step)
    if step is not None:
        raise UserError(f"--step is for run directories (with a checkpoints/ folder); {arg!r} is not one")
    if arg in PRESETS:
        raise UserError(f"{arg!r} is a preset without weights; pass a Hugging Face model directory or a run directory")
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.hf.weights import has_any_weights, no_weights_reason

    cfg = read_model_config(arg)  # first: a file that is no config.json is named as such
    folder = config_path(arg).parent
    if not has_any_weights(folder):
        raise UserError(f"{no_weights_reason(folder)} to generate with (a model directory or a run directory is needed)")
    return ModelSource(cfg, folder, False, folder)


def load_model(source: ModelSource, mesh, expert_slots: dict | None = None):
    """This rank's part of the model in the mesh's layout, with the source's weights
    (`expert_slots`: `parallelize`'s, for `phalanx serve --expert-slots`)."""
    # Imported when run, not at the top: it brings in numpy, torch, which start-up need not wait for.
    from phalanx.parallel.apply import parallelize

    weights = None
    if not source.is_run:
        # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
        from phalanx.hf.weights import CheckpointWeights

        weights = CheckpointWeights(source.weights_dir, source.cfg)
    model = parallelize(source.cfg, mesh, seed=0, weights=weights, expert_slots=expert_slots)
    if source.is_run:
        _load_run_checkpoint(model, source)
    return model.eval()


def _load_run_checkpoint(model, source: ModelSource) -> None:
    """The model part of a training checkpoint (its optimizer state is not read)."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.checkpoint.store import load_model_weights

    load_model_weights(source.weights_dir, model, tied=source.cfg.tie_embeddings)


@dataclass(frozen=True)
class TextCodec:
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    """Every id to text, special tokens included."""
    eos_id: int | None
    """Generation stops after this id; None: the tokenizer has no end-of-text token (bytes)."""
    eos_ids: frozenset[int] = frozenset()
    """Every id that ends a sequence: `eos_id` and the checkpoint's (generation_config.py)."""
    decode_plain: Callable[[list[int]], str] | None = None
    """Ids to text without special tokens (vLLM's `skip_special_tokens`); None: as `decode`."""
    encode_special: Callable[[str], list[int]] | None = None
    """Text to ids with the special tokens the tokenizer's post-processor adds (a BOS, as
    `transformers`' `tokenizer(text)` and vLLM's `add_special_tokens` give); None: as `encode`."""
    tokenizer_file: Path | None = None
    """The tokenizer.json (None: the byte tokenizer), from which structured output's grammars
    learn each token's bytes (grammar.py)."""


def text_codec(model_dir: Path | None, tokenizer: str = "") -> TextCodec:
    """Prompt text <-> ids: `tokenizer` ("bytes", or a tokenizer.json or its folder), else the
    model (or run) directory's tokenizer.json, else bytes (`phalanx.data.tokenizer`, as in
    training); the ends of sequence from the tokenizer and `model_dir`'s own files."""
    # Imported when run, not at the top: it brings in numpy, which start-up need not wait for.
    from phalanx.data.tokenizer import load_tokenizer

    loaded = load_tokenizer(tokenizer, model_dir)
    eos = checkpoint_eos_ids(model_dir) | set(getattr(loaded, "eos_ids", ())) | ({loaded.eos_id} - {None})
    eos = {token for token in eos if token < loaded.vocab_size}
    special = None
    if hasattr(loaded, "decode_plain"):  # a tokenizers tokenizer (bytes have no special tokens to add)
        special = lambda text: [int(t) for t in loaded.encode(text, add_special_tokens=True)]  # noqa: E731
    return TextCodec(lambda text: [int(t) for t in loaded.encode(text)], loaded.decode, loaded.eos_id,
                     frozenset(eos), getattr(loaded, "decode_plain", None), encode_special=special,
                     tokenizer_file=loaded.source)
