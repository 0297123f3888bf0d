"""What a checkpoint's own files say about generating from it: its end-of-sequence ids and its
sampling defaults (torch-free).

Instruct checkpoints name their end of turn in `generation_config.json` (Qwen:
`[<|im_end|>, <|endoftext|>]`; Llama 3: `[128001, 128008, 128009]`), often not as the
tokenizer's `eos_token`: a server that stops only on the tokenizer's would run past the end of
the answer. So the ids that end a sequence are the union of `generation_config.json`'s
`eos_token_id`, `config.json`'s and the tokenizer's (as vLLM takes them). The sampling defaults
(`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`) fill the fields a request
leaves out, as vLLM's `--generation-config auto` does.
"""

from __future__ import annotations

import json
from pathlib import Path

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _read(path: Path) -> dict:
    """A JSON object from `path`, or {} when it is missing or not an object: these files are
    optional, and a malformed one must not stop a model that loads otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _ids(value) -> set[int]:
    values = value if isinstance(value, list) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def checkpoint_eos_ids(model_dir: Path | None) -> set[int]:
    """`eos_token_id` of generation_config.json and config.json in `model_dir` (int or list)."""
    if model_dir is None:
        return set()
    return _ids(_read(model_dir / "generation_config.json").get("eos_token_id")) | _ids(
        _read(model_dir / "config.json").get("eos_token_id"))


def sampling_defaults(model_dir: Path | None) -> dict[str, float]:
    """generation_config.json's sampling settings that are numbers, by vLLM's field names."""
    if model_dir is None:
        return {}
    data = _read(model_dir / "generation_config.json")
    return {key: data[key] for key in SAMPLING_KEYS
            if isinstance(data.get(key), (int, float)) and not isinstance(data.get(key), bool)}
