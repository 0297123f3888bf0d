"""Reading a prepared directory (what `phalanx prepare` writes; format in docs/data.md).

The shards are memory-mapped: a rank reads only the windows of its batches, so a corpus far
larger than memory trains. Each split is a list of token ranges over the shards; a split of
several ranges reads as one sequence through `TokenRanges`.

Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phalanx.errors import UserError

FORMAT = "phalanx-prepared-v1"
MANIFEST = "data.json"


class TokenRanges:
    """Several token arrays read as one: `len()` and contiguous slices, as `take_windows` needs."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.ends = np.cumsum([len(p) for p in parts])  # end offset of each part

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.parts) else 0

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise IndexError("TokenRanges supports contiguous slices only")
        pieces = []
        first = int(np.searchsorted(self.ends, start, side="right"))
        for i in range(first, len(self.parts)):
            begin = int(self.ends[i] - len(self.parts[i]))
            if begin >= stop:
                break
            pieces.append(self.parts[i][max(start - begin, 0) : stop - begin])
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, self.parts[0].dtype if self.parts else np.uint16)


@dataclass(frozen=True)
class Prepared:
    root: Path
    manifest: dict
    train: np.ndarray | TokenRanges
    val: np.ndarray | TokenRanges
    train_documents: np.ndarray | None = None
    """Where each train document starts (int64 offsets into `train`); None when the directory
    was prepared before document starts were recorded."""
    val_documents: np.ndarray | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def tokenizer_file(self) -> Path | None:
        """The copy of the tokenizer.json the data was prepared with (None: bytes)."""
        name = self.manifest["tokenizer"].get("file")
        return self.root / name if name else None


def is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def _split(root: Path, manifest: dict, name: str, maps: dict[str, np.ndarray]) -> np.ndarray | TokenRanges:
    parts = []
    for file, start, stop in manifest[name]["ranges"]:
        if file not in maps:
            raise UserError(f"{root / MANIFEST}: split {name!r} names shard {file!r}, which is not among its shards")
        if not 0 <= start <= stop <= len(maps[file]):
            raise UserError(f"{root / MANIFEST}: range {start}..{stop} of {file} is outside its {len(maps[file])} tokens")
        parts.append(maps[file][start:stop])
    return parts[0] if len(parts) == 1 else TokenRanges(parts)


def open_prepared(root: Path) -> Prepared:
    """The prepared directory at `root`, its shards memory-mapped and checked against data.json."""
    where = root / MANIFEST
    try:
        manifest = json.loads(where.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"{where} is not readable JSON ({error}); prepare the directory again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{where} is not a phalanx prepared directory (expected \"format\": \"{FORMAT}\")")
    try:
        dtype = np.dtype(manifest["dtype"])
        maps = {}
        for shard in manifest["shards"]:
            file = root / shard["file"]
            if not file.is_file() or file.stat().st_size != shard["tokens"] * dtype.itemsize:
                raise UserError(f"{file}: missing or not {shard['tokens']:,} {dtype} tokens as {MANIFEST} says")
            maps[shard["file"]] = np.memmap(file, dtype=dtype, mode="r") if shard["tokens"] else np.zeros(0, dtype)
        train, val = _split(root, manifest, "train", maps), _split(root, manifest, "val", maps)
        int(manifest["vocab_size"]), manifest["tokenizer"]["fingerprint"]  # noqa: B018 (presence checks)
    except (KeyError, TypeError, ValueError) as error:
        raise UserError(f"{where} is malformed ({type(error).__name__}: {error}); prepare the directory again") from None
    return Prepared(root, manifest, train, val, *(_document_starts(root, manifest[name]) for name in ("train", "val")))


def _document_starts(root: Path, record: dict) -> np.ndarray | None:
    name = record.get("document_starts")
    if not name:
        return None
    try:
        starts = np.load(root / name, mmap_mode="r")
    except (OSError, ValueError) as error:
        raise UserError(f"{root / name}: unreadable document starts ({error}); prepare the directory again") from None
    tokens = sum(stop - start for _, start, stop in record.get("ranges", []))
    if problem := _starts_problem(starts, tokens):
        raise UserError(f"{root / name}: {problem}; prepare the directory again")
    return starts


def _starts_problem(starts: np.ndarray, tokens: int) -> str | None:
    """What is wrong with a split's document starts (--doc-mask masks attention by them): one
    dimension of integers, from 0, in order, each before the split's end."""
    if starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer):
        return f"document starts must be one dimension of integers, not {starts.ndim}-D {starts.dtype}"
    if len(starts) == 0 and tokens == 0:
        return None  # an empty split (no validation documents)
    if len(starts) == 0 or starts[0] != 0:
        return "document starts must begin with 0 (the first document)"
    if len(starts) > 1 and (np.diff(starts) < 0).any():
        return "document starts are not in increasing order"
    if starts[-1] >= max(tokens, 1):
        return f"a document starts at {int(starts[-1])}, past the split's {tokens} tokens"
    return None
