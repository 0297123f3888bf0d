"""Where training tokens come from: a prepared directory (`phalanx prepare`, memory-mapped),
a text file or folder tokenized on the fly with the run's tokenizer, a pre-tokenized `.bin` of
uint16 tokens, or by default the standard library's sources.

The default corpus exists on every machine with Python: the `.py` files of the running
interpreter's standard library. Files are split into train and validation by a hash of their
relative path, so the split is deterministic and no file straddles it.

`open_training_data` + `check_corpus` run in the launcher before any worker starts, and again
in each worker (an external torchrun has no launcher of ours).
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phalanx.data.prepared import TokenRanges, is_prepared, open_prepared
from phalanx.data.sources import TEXT_SUFFIXES, read_text, text_files
from phalanx.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    token_dtype,
)
from phalanx.errors import UserError
from phalanx.model.hf_config import model_directory

VALIDATION_SHARE = 20
"""One file in 20 (by path hash) goes to validation."""


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray | TokenRanges
    """Token ids (uint8 for bytes, uint16/uint32 otherwise), memory-mapped where possible."""
    val: np.ndarray | TokenRanges
    description: str
    tokenizer: Tokenizer = ByteTokenizer()
    """What the ids mean: the run's tokenizer (for a prepared directory, the one it was made with)."""
    id_bound: int = 256
    """Every token id is below this (the tokenizer's vocabulary, or a `.bin`'s largest id + 1)."""
    train_documents: np.ndarray | None = None
    """Where each document of `train` starts (a prepared directory's record), for `--doc-mask`;
    None where the data does not say."""
    val_documents: np.ndarray | None = None


def _is_validation(relative: str) -> bool:
    return zlib.crc32(relative.encode()) % VALIDATION_SHARE == 0


def _bytes_corpus(files: list[Path], root: Path, description: str) -> Corpus:
    train_parts, val_parts = [], []
    for path in files:
        data = path.read_bytes()
        if data:
            (val_parts if _is_validation(str(path.relative_to(root))) else train_parts).append(data)
    if not train_parts:
        raise UserError(f"no text found in {description}")
    if not val_parts:  # a small folder may hash every file to train: hold out its tail instead
        joined = b"\n".join(train_parts)
        cut = len(joined) * (VALIDATION_SHARE - 1) // VALIDATION_SHARE
        train_parts, val_parts = [joined[:cut]], [joined[cut:]]
    train = np.frombuffer(b"\n".join(train_parts), dtype=np.uint8)
    val = np.frombuffer(b"\n".join(val_parts), dtype=np.uint8)
    return Corpus(train, val, f"{description}: {len(train):,} train / {len(val):,} validation tokens")


def _text_corpus(files: list[Path], root: Path, description: str, tok: HFTokenizer) -> Corpus:
    """Files tokenized as documents, each followed by the end-of-text token where there is one."""
    dtype = token_dtype(tok.vocab_size)
    texts = {p: read_text(p, any_bytes=False) for p in files}  # a file that is not UTF-8 is an error naming it
    texts = {p: t for p, t in texts.items() if t}
    if not texts:
        raise UserError(f"no text found in {description}")
    eos = [] if tok.eos_id is None else [tok.eos_id]
    train_parts, val_parts = [], []
    for path, ids in zip(texts, tok.encode_batch(list(texts.values()))):
        (val_parts if _is_validation(str(path.relative_to(root))) else train_parts).extend([ids, eos])
    if not train_parts or not val_parts:  # every file on one side: hold out the tail of all
        joined = np.concatenate(train_parts + val_parts)
        cut = len(joined) * (VALIDATION_SHARE - 1) // VALIDATION_SHARE
        train_parts, val_parts = [joined[:cut]], [joined[cut:]]
    train, val = np.concatenate(train_parts).astype(dtype), np.concatenate(val_parts).astype(dtype)
    return Corpus(train, val, f"{description}: {len(train):,} train / {len(val):,} validation tokens ({tok.name})",
                  tok, tok.vocab_size)


def _from_files(files: list[Path], root: Path, description: str, tok: Tokenizer) -> Corpus:
    if isinstance(tok, ByteTokenizer):
        return _bytes_corpus(files, root, description)
    return _text_corpus(files, root, description, tok)


_STDLIB_CACHE: dict[str, Corpus] = {}
"""The default corpus per tokenizer fingerprint, read once per process: the launcher reads it
to check the data, and workers forked from it (and test ranks forked from pytest) inherit it
instead of each reading and joining some 700 files again. The arrays are read-only."""


def stdlib_corpus(tokenizer: Tokenizer | None = None) -> Corpus:
    tok = tokenizer or ByteTokenizer()
    if tok.fingerprint not in _STDLIB_CACHE:
        _STDLIB_CACHE.clear()  # one tokenizer's at a time: a run uses one
        _STDLIB_CACHE[tok.fingerprint] = _read_stdlib_corpus(tok)
    return _STDLIB_CACHE[tok.fingerprint]


def _read_stdlib_corpus(tokenizer: Tokenizer) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    # Skip tests and vendored packages: they are large, repetitive, and vary between builds.
    files = sorted(
        p for p in root.rglob("*.py")
        if not {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    )
    if not files:
        raise UserError(f"no Python sources found under {root} for the default corpus; pass --data PATH")
    description = f"Python {sysconfig.get_python_version()} standard library ({len(files)} files)"
    return _from_files(files, root, description, tokenizer)


def check_data_path(path: str) -> Path:
    """Cheap checks of a --data path (before any worker starts); returns it resolved."""
    target = Path(path).expanduser()
    if not target.exists():
        raise UserError(f"data path {path!r} does not exist")
    if is_prepared(target):
        return target
    if target.is_dir():
        if not text_files(target):
            raise UserError(f"data folder {path!r} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))}) "
                            "and no data.json of a prepared directory")
    elif target.stat().st_size == 0:
        raise UserError(f"data file {path!r} is empty")
    elif target.suffix == ".bin" and target.stat().st_size % 2:
        raise UserError(f"{path!r} has an odd size; a .bin must hold uint16 tokens")
    return target


def load_corpus(path: str | None, tokenizer: Tokenizer | None = None) -> Corpus:
    """The corpus at `path` (prepared directory, file, folder or `.bin`), or the standard
    library when None; text is tokenized with `tokenizer` (default: bytes)."""
    tok = tokenizer or ByteTokenizer()
    if not path:
        return stdlib_corpus(tok)
    target = check_data_path(path)
    if is_prepared(target):
        data = open_prepared(target)
        if data.manifest["tokenizer"]["fingerprint"] != tok.fingerprint:
            raise UserError(f"{path} was prepared with tokenizer {data.manifest['tokenizer']['name']!r}, "
                            f"but this run tokenizes with {tok.name!r}; drop --tokenizer or prepare the data again")
        m = data.manifest
        return Corpus(data.train, data.val, f"{path}: {m['train']['tokens']:,} train / {m['val']['tokens']:,} "
                      f"validation tokens of {m['documents']:,} documents ({m['tokenizer']['name']})",
                      tok, data.vocab_size, data.train_documents, data.val_documents)
    if target.is_dir():
        files = text_files(target)
        return _from_files(files, target, f"{path} ({len(files)} files)", tok)
    if target.suffix == ".bin":
        tokens = np.memmap(target, dtype=np.uint16, mode="r")
        cut = len(tokens) * (VALIDATION_SHARE - 1) // VALIDATION_SHARE
        return Corpus(tokens[:cut], tokens[cut:], f"{path}: {cut:,} train / {len(tokens) - cut:,} validation tokens",
                      tok, int(tokens.max()) + 1)
    return _from_files([target], target.parent, path, tok)


def run_tokenizer(spec: str, *, model: str, data: str) -> Tokenizer:
    """The tokenizer of a run: `--tokenizer` when given; else the model directory's
    tokenizer.json; else, for a prepared directory, the one it was made with; else bytes."""
    folder = model_directory(model)
    if spec or (folder is not None and (folder / "tokenizer.json").is_file()):
        return load_tokenizer(spec, folder)
    target = Path(data).expanduser() if data else None
    if target is not None and is_prepared(target):
        made_with = open_prepared(target).tokenizer_file
        return load_tokenizer(str(made_with) if made_with else "bytes")
    return ByteTokenizer()


def open_training_data(*, data: str, tokenizer: str, model: str) -> Corpus:
    """The run's corpus, its ids in the run's tokenizer (settings as in TrainConfig)."""
    if data:
        check_data_path(data)  # a missing path is reported as such, before any tokenizer is read
    return load_corpus(data, run_tokenizer(tokenizer, model=model, data=data))


def check_corpus(corpus: Corpus, *, model: str, model_vocab: int, seq_len: int, needs_val: bool,
                 doc_mask: bool = False) -> None:
    """Refuse, in one line, data this model cannot train on: found before any worker starts."""
    tok = corpus.tokenizer
    if doc_mask and corpus.train_documents is None:
        raise UserError(f"--doc-mask needs to know where documents start, which {corpus.description.split(':')[0]} "
                        "does not record; give --data a directory made by phalanx prepare (prepare it again if it is older)")
    if tok.vocab_size > model_vocab:
        raise UserError(f"tokenizer {tok.name!r} has a vocabulary of {tok.vocab_size:,} tokens, more than "
                        f"model {model!r}'s {model_vocab:,}; choose a model with a larger vocabulary or another --tokenizer")
    if corpus.id_bound > model_vocab:
        raise UserError(f"the data holds token ids up to {corpus.id_bound - 1:,}, beyond the vocabulary of "
                        f"model {model!r} ({model_vocab:,})")
    need = seq_len + 2  # a window of seq_len + 1 tokens, at a random start (batches.window_starts)
    for name, tokens in (("train", corpus.train), ("validation", corpus.val) if needs_val else (None, None)):
        if name and len(tokens) < need:
            raise UserError(f"the {name} split holds {len(tokens):,} tokens (train {len(corpus.train):,}, validation "
                            f"{len(corpus.val):,}), fewer than seq_len + 2 = {need:,}; lower --seq-len or give more data"
                            + (" (or --eval-every 0)" if name == "validation" else ""))
