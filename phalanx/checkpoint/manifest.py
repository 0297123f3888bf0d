"""What makes a checkpoint folder complete: its phalanx.json lists every file DCP wrote with
its size and BLAKE2b checksum, and a checkpoint is used only when every listed file is there
and matches. A truncated shard, flipped bytes, a missing `.metadata` or an unreadable
phalanx.json are caught before DCP reads anything (DCP itself would load flipped bytes
silently, or fail with an unreadable traceback)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

META_FILE = "phalanx.json"


def file_digest(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "blake2b").hexdigest()


def build_manifest(folder: Path) -> dict[str, dict]:
    """{relative path: {"size", "blake2b"}} of every file under `folder` but phalanx.json."""
    return {
        str(path.relative_to(folder)): {"size": path.stat().st_size, "blake2b": file_digest(path)}
        for path in sorted(folder.rglob("*")) if path.is_file() and path.name != META_FILE
    }


def read_meta(folder: Path) -> dict:
    """The checkpoint's phalanx.json; ValueError (with the reason) if it is missing or damaged."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(f"{META_FILE} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{META_FILE} is not valid JSON") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise ValueError(f"{META_FILE} has no step number")
    return meta


def damage(folder: Path, meta: dict) -> str | None:
    """Why the checkpoint in `folder` cannot be trusted, or None when every file matches."""
    manifest = meta.get("manifest")
    if not isinstance(manifest, dict) or ".metadata" not in manifest:
        return f"{META_FILE} has no manifest of the checkpoint's files"
    for name, expected in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected.get("size"):
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected.get('size')} (truncated?)"
        if file_digest(path) != expected.get("blake2b"):
            return f"{name} does not match its checksum (corrupt)"
    return None
