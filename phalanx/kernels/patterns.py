"""Reading the inputs of `phalanx match`: the pattern file and the texts.

Torch-free, so that bad input is reported before any worker starts.
"""

from __future__ import annotations

from pathlib import Path

from phalanx.errors import UserError


def parse_patterns(raw: bytes, name: str = "the pattern file") -> list[bytes]:
    """One pattern per line: split on b"\\n" only, nothing stripped (a "\\r" stays part of its
    pattern), empty lines skipped; a pattern's index counts the non-empty lines before it."""
    patterns: list[bytes] = []
    first_line: dict[bytes, int] = {}
    for line_number, line in enumerate(raw.split(b"\n"), start=1):
        if not line:
            continue
        if line in first_line:
            raise UserError(f"{name}: line {line_number} repeats the pattern of line {first_line[line]} ({line[:40]!r})")
        first_line[line] = line_number
        patterns.append(line)
    if not patterns:
        raise UserError(f"{name} holds no patterns (every line is empty)")
    return patterns


def read_patterns(path: str | Path) -> list[bytes]:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise UserError(f"cannot read the pattern file {path}: {error.strerror or error}") from None
    return parse_patterns(raw, name=str(path))


def check_patterns(patterns: list[bytes]) -> None:
    """The same rules for patterns given through the Python API (indexes instead of lines)."""
    if not patterns:
        raise UserError("no patterns given")
    first: dict[bytes, int] = {}
    for index, pattern in enumerate(patterns):
        if not isinstance(pattern, (bytes, bytearray)):
            raise UserError(f"pattern {index} is {type(pattern).__name__}, not bytes")
        if not pattern:
            raise UserError(f"pattern {index} is empty")
        if bytes(pattern) in first:
            raise UserError(f"pattern {index} repeats pattern {first[bytes(pattern)]} ({bytes(pattern)[:40]!r})")
        first[bytes(pattern)] = index


def expand_inputs(paths: list[str | Path]) -> list[Path]:
    """Files as given; a folder stands for its files (recursively) in sorted path order."""
    if not paths:
        raise UserError("no INPUT given")
    files: list[Path] = []
    for given in map(Path, paths):
        if given.is_dir():
            found = sorted(p for p in given.rglob("*") if p.is_file())
            if not found:
                raise UserError(f"input folder {given} holds no files")
            files.extend(found)
        elif given.exists():
            files.append(given)
        else:
            raise UserError(f"input {given} does not exist")
    return files


def read_inputs(paths: list[str | Path]) -> list[bytes]:
    data = []
    for path in expand_inputs(paths):
        try:
            data.append(path.read_bytes())
        except OSError as error:
            raise UserError(f"cannot read input {path}: {error.strerror or error}") from None
    return data
