"""Where training text comes from: the standard library's sources, a text file or folder,
or a pre-tokenized `.bin` of uint16 tokens.

The default corpus exists on every machine with Python: the `.py` files of the running
interpreter's standard library, read as bytes. Files are split into train and validation by
a hash of their relative path, so the split is deterministic and no file straddles it.
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phalanx.errors import UserError

VALIDATION_SHARE = 20
"""One file in 20 (by path hash) goes to validation."""

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".csv", ".html", ".c", ".h", ".toml", ".yaml", ".yml"}


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray
    """Token ids (uint8 for bytes, uint16 for `.bin` files), memory-mapped where possible."""
    val: np.ndarray
    description: str


def _is_validation(relative: str) -> bool:
    return zlib.crc32(relative.encode()) % VALIDATION_SHARE == 0


def _from_files(files: list[Path], root: Path, description: str) -> Corpus:
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


def stdlib_corpus() -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    # Skip tests and vendored packages: they are large, repetitive, and vary between builds.
    files = sorted(
        p for p in root.rglob("*.py")
        if not {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    )
    if not files:
        raise UserError(f"no Python sources found under {root} for the default corpus; pass --data PATH")
    return _from_files(files, root, f"Python {sysconfig.get_python_version()} standard library ({len(files)} files)")


def _text_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)


def check_data_path(path: str) -> Path:
    """Cheap checks of a --data path (before any worker starts); returns it resolved."""
    target = Path(path).expanduser()
    if not target.exists():
        raise UserError(f"data path {path!r} does not exist")
    if target.is_dir():
        if not _text_files(target):
            raise UserError(f"data folder {path!r} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
    elif target.stat().st_size == 0:
        raise UserError(f"data file {path!r} is empty")
    elif target.suffix == ".bin" and target.stat().st_size % 2:
        raise UserError(f"{path!r} has an odd size; a .bin must hold uint16 tokens")
    return target


def load_corpus(path: str | None) -> Corpus:
    """The corpus at `path` (file, folder or `.bin`), or the standard library when None."""
    if not path:
        return stdlib_corpus()
    target = check_data_path(path)
    if target.is_dir():
        files = _text_files(target)
        return _from_files(files, target, f"{path} ({len(files)} files)")
    if target.suffix == ".bin":
        tokens = np.memmap(target, dtype=np.uint16, mode="r")
        cut = len(tokens) * (VALIDATION_SHARE - 1) // VALIDATION_SHARE
        return Corpus(tokens[:cut], tokens[cut:], f"{path}: {cut:,} train / {len(tokens) - cut:,} validation tokens")
    return _from_files([target], target.parent, path)
