"""Documents out of the sources `phalanx prepare` reads: text files, folders, JSONL, parquet.

A text file is one document; each JSONL line and each parquet row is one. Documents come in
a fixed order (the sources in the order given, a folder's files sorted by path), so a prepared
directory is a pure function of its inputs. Every reader yields `(document, source_bytes)`:
the text and about how many bytes of the source it used up, for the progress bar.

Torch-free: `phalanx prepare` imports this.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

from phalanx.errors import UserError

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".csv", ".html", ".c", ".h", ".toml", ".yaml", ".yml"}
"""What a folder's text files end in (files named on the command line are read whatever they end in)."""

RECORD_SUFFIXES = {".jsonl", ".parquet"}

MAX_DOCUMENT_BYTES = 2**28
"""The largest single document (a text file, a JSONL line, a parquet cell): 256 MiB. Reading
stops there and names the size, so one runaway line cannot take the machine's memory; split
such a text into several documents first."""


def _too_big(where: str, size: int) -> UserError:
    return UserError(f"{where}: a document of {size / 2**20:,.0f} MiB or more; at most {MAX_DOCUMENT_BYTES // 2**20} MiB "
                     "per document (split it into several lines or files)")


def _prepared_dirs(folder: Path) -> list[Path]:
    """Folders under `folder` that are an earlier `phalanx prepare` output (their data.json
    is its record, not a document)."""
    # Imported when run, not at the top: it brings in numpy, which start-up need not wait for.
    from phalanx.data.prepared import FORMAT, MANIFEST

    def prepared(record: Path) -> bool:
        try:
            return json.loads(record.read_bytes()[:2**20]).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            return False  # not JSON, or not an object: an ordinary file

    return [p.parent for p in folder.rglob(MANIFEST) if prepared(p)]


def text_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)


def source_files(specs: list[str]) -> list[Path]:
    """The files the sources name, in order; a folder gives its text, JSONL and parquet files."""
    files: list[Path] = []
    for spec in specs:
        path = Path(spec).expanduser()
        if not path.exists():
            raise UserError(f"source {spec!r} does not exist")
        if path.is_dir():
            skipped = _prepared_dirs(path)
            for folder in skipped:
                print(f"phalanx: warning: skipping {folder}: it is a prepared directory (phalanx prepare output), "
                      "not text", file=sys.stderr)
            found = sorted(p for p in path.rglob("*") if p.is_file()
                           and p.suffix.lower() in TEXT_SUFFIXES | RECORD_SUFFIXES
                           and not any(folder in p.parents for folder in skipped))
            if not found:
                raise UserError(f"source folder {spec!r} holds no text, .jsonl or .parquet files")
            files.extend(found)
        else:
            files.append(path)
    return files


def read_text(path: Path, *, any_bytes: bool) -> str | bytes:
    """A text file's contents: bytes as they are when the tokenizer takes any bytes, else
    decoded UTF-8, where a file that is not UTF-8 text is an error naming it."""
    try:
        size = path.stat().st_size
        if size > MAX_DOCUMENT_BYTES:
            raise _too_big(str(path), size)
        with path.open("rb") as file:
            data = file.read(MAX_DOCUMENT_BYTES + 1)  # /proc files say size 0: read at most the bound
    except OSError as error:
        raise UserError(f"cannot read source {path} ({error.strerror or error})") from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise _too_big(str(path), len(data))
    if any_bytes:
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{path} is not UTF-8 text (invalid byte at offset {error.start}); "
                        "a text tokenizer reads only UTF-8 (use --tokenizer bytes to train on raw bytes)") from None


def _jsonl_documents(path: Path, field: str) -> Iterator[tuple[str, int]]:
    with path.open("rb") as lines:
        for number, line in enumerate(iter(lambda: lines.readline(MAX_DOCUMENT_BYTES + 1), b""), start=1):
            if len(line) > MAX_DOCUMENT_BYTES:  # read no further than the bound
                raise _too_big(f"{path}, line {number}", len(line))
            if not line.strip():
                yield "", len(line)  # blank lines are no documents, but they count as progress
                continue
            try:
                record = json.loads(line)
            except ValueError as error:  # UnicodeDecodeError is a ValueError too
                raise UserError(f"{path}, line {number}: not valid JSON ({error})") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                found = "has no field" if not isinstance(record, dict) or field not in record else "has a non-string"
                raise UserError(f"{path}, line {number}: {found} {field!r} (choose the field with --field)")
            yield text, len(line)


def _parquet_documents(path: Path, field: str) -> Iterator[tuple[str, int]]:
    # Imported when run, not at the top: it brings in pyarrow, which start-up need not wait for.
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid and OSError variants
        raise UserError(f"{path}: not a readable parquet file ({error})") from None
    columns = table.schema_arrow.names
    if field not in columns:
        raise UserError(f"{path} has no column {field!r} (columns: {', '.join(columns)}; choose one with --field)")
    rows, size = max(table.metadata.num_rows, 1), path.stat().st_size
    row = 0
    for batch in table.iter_batches(columns=[field], batch_size=4096):
        texts = batch.column(0).to_pylist()
        for text in texts:
            row += 1
            if not isinstance(text, str):
                raise UserError(f"{path}, row {row}: column {field!r} holds {type(text).__name__}, not text")
            yield text, size // rows


def documents(path: Path, *, field: str, any_bytes: bool) -> Iterator[tuple[str | bytes, int]]:
    """The documents of one source file, by its kind (.jsonl, .parquet, else text)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_documents(path, field)
    elif suffix == ".parquet":
        yield from _parquet_documents(path, field)
    else:
        yield read_text(path, any_bytes=any_bytes), path.stat().st_size
