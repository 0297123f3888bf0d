"""Tokenizers: bytes (token i is byte i, vocabulary 256) or a Hugging Face `tokenizer.json`.

`load_tokenizer(spec, model_dir)` resolves what a run or `phalanx prepare` tokenizes with:
- "" (default): `model_dir/tokenizer.json` when the model directory has one, else bytes;
- "bytes": the byte tokenizer, under which any file is data;
- a path to a `tokenizer.json`, or to a folder holding one.

Torch-free: `phalanx prepare` and its worker processes import this.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from phalanx.errors import UserError

VOCAB_SIZE = 256
"""The byte tokenizer's vocabulary."""

END_OF_TEXT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|end|>")
"""Special tokens that end a document in published tokenizers (GPT-2/Qwen, Llama 3, Llama 2 and
Mistral, Gemma, Phi-3). Looked for before the configured `eos_token`, because an instruct
model's eos is often the end of a chat turn (`<|eot_id|>`, `<|im_end|>`), while documents of
its pretraining corpus were separated by one of these."""


class ByteTokenizer:
    """Token i is byte i; decoding replaces invalid UTF-8 (a model can emit half a character)."""

    name = "bytes"
    vocab_size = VOCAB_SIZE
    eos_id: int | None = None
    source: Path | None = None
    fingerprint = "bytes"
    reads_any_bytes = True
    """Any file is data: no UTF-8 check."""

    def encode(self, text: str | bytes, *, add_special_tokens: bool = False) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8)

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        return bytes(int(t) & 0xFF for t in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from its `tokenizer.json`."""

    reads_any_bytes = False

    def __init__(self, path: Path):
        # Imported when run, not at the top: it brings in tokenizers, which start-up need not wait for.
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust side raises plain Exception on a malformed file
            raise UserError(f"cannot read tokenizer {path}: {str(error).splitlines()[0]}") from None
        self.source = path
        self.name = str(path)
        # The id bound, not the count: ids of added tokens can leave gaps.
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        self.eos_id = _end_of_text_id(self._tok, path.parent)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.eos_ids = frozenset({self.eos_id, _configured_eos(path.parent, vocab)} - {None})
        """The end-of-text token and the configured eos_token, which an instruct model's chat
        turns end with (`<|eot_id|>`, `<|im_end|>`)."""
        self.fingerprint = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        """Identifies the vocabulary: data prepared with one tokenizer is refused under another."""

    def encode(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        """Ids of `text`; by default without the post-processor's BOS/EOS, since documents are
        joined with the end-of-text token by the caller."""
        return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids) -> str:
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=False)

    def decode_plain(self, ids) -> str:
        """Text without the special tokens (end of turn, chat markers): what a served answer shows."""
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=True)


Tokenizer = ByteTokenizer | HFTokenizer


def _configured_eos(folder: Path, vocab: dict[str, int]) -> int | None:
    """The eos token named by a tokenizer_config.json or config.json beside the tokenizer."""
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
        try:
            value = json.loads((folder / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):  # {"content": "</s>", ...} in older tokenizer_config files
            value = value.get("content")
        if isinstance(value, list) and value:  # config.json may list several eos ids
            value = value[0]
        if isinstance(value, str) and value in vocab:
            return vocab[value]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _end_of_text_id(tok, folder: Path) -> int | None:
    vocab = tok.get_vocab(with_added_tokens=True)
    for name in END_OF_TEXT_NAMES:
        if name in vocab:
            return vocab[name]
    return _configured_eos(folder, vocab)


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that a path names (the file itself, or the one in a folder)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"tokenizer {spec!r}: no such file (give a tokenizer.json, a folder holding one, or 'bytes')")
    return path


def load_tokenizer(spec: str, model_dir: Path | None = None) -> Tokenizer:
    """The tokenizer that `spec` names ("" = the model directory's tokenizer.json, else bytes)."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec:
        return HFTokenizer(tokenizer_file(spec))
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        return HFTokenizer(model_dir / "tokenizer.json")
    return ByteTokenizer()


def save_tokenizer_files(tok: Tokenizer, folder: Path) -> str | None:
    """Copy the tokenizer's files into `folder` (a prepared directory, a run directory), so
    that it is complete on its own; returns the tokenizer.json's name there (None: bytes)."""
    if tok.source is None:
        return None
    shutil.copyfile(tok.source, folder / "tokenizer.json")
    beside = tok.source.parent / "tokenizer_config.json"  # may name the eos token
    if beside.is_file():
        shutil.copyfile(beside, folder / "tokenizer_config.json")
    return "tokenizer.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id: uint16 up to 65,536 tokens, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


# Byte-level functions kept for callers that predate the tokenizer objects.
def encode(text: str | bytes) -> np.ndarray:
    return ByteTokenizer().encode(text)


def decode(tokens) -> str:
    return ByteTokenizer().decode(tokens)
