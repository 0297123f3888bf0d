"""Whether a command can write where it was told to, asked before it does any work (a
calibration that measures for 40 s, a simulation, a tokenization) so a bad output path is a
one-line error up front, never a traceback at the end. Torch-free.

The test is a real one: a probe file is created (and removed) in the nearest folder that
exists, because permission bits say nothing for root, and /proc or a read-only mount refuse
only when asked."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from phalanx.errors import UserError


def _nearest_existing(path: Path) -> Path:
    for folder in (path, *path.parents):
        if folder.exists():
            return folder
    return Path(".")


def _probe(folder: Path, what: str, given: str | Path) -> None:
    try:
        handle, name = tempfile.mkstemp(prefix=".phalanx-probe-", dir=folder)
    except OSError as error:
        raise UserError(f"{what} {given}: cannot write in {folder} ({error.strerror or error})") from None
    os.close(handle)
    os.unlink(name)


def check_output_file(path: str | Path, what: str) -> Path:
    """A file the command will create or replace (its folders may not exist yet)."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise UserError(f"{what} {path} is a folder; name a file")
    if target.exists():
        try:
            with open(target, "r+b"):
                pass
        except OSError as error:
            raise UserError(f"{what} {path}: cannot write it ({error.strerror or error})") from None
        return target
    folder = _nearest_existing(target.parent)
    if not folder.is_dir():
        raise UserError(f"{what} {path}: {folder} is a file, not a folder")
    _probe(folder, what, path)
    return target


def check_output_folder(path: str | Path, what: str, *, empty: bool = False) -> Path:
    """A folder the command will create, or write into (`empty`: only if it is empty)."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise UserError(f"{what} {path} is a file, not a folder")
    if empty and target.is_dir() and any(target.iterdir()):
        raise UserError(f"{what} {path} already exists and is not an empty folder; choose another or remove it")
    folder = _nearest_existing(target)
    if not folder.is_dir():
        raise UserError(f"{what} {path}: {folder} is a file, not a folder")
    _probe(folder, what, path)
    return target
