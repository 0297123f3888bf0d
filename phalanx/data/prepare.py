"""`phalanx prepare`: tokenize text, folders, JSONL and parquet once, into a prepared directory
that training memory-maps (format: docs/data.md).

Worker processes encode chunks of documents; the parent writes their tokens in document order,
so the result does not depend on the number of workers. Each document is followed by the
tokenizer's end-of-text token where it has one, and where each document starts is recorded
(`<split>_documents.npy`, for `phalanx train --doc-mask`). A document goes to validation when a hash of
its position in the input falls below `val_fraction`: deterministic, streaming (no count needed
up front) and spread over the whole input. Everything is written into a temporary folder
beside the target and renamed into place at the end, so an error leaves nothing half written.

Torch-free.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from phalanx.data.prepared import FORMAT, MANIFEST
from phalanx.data.sources import documents, source_files
from phalanx.data.tokenizer import Tokenizer, load_tokenizer, save_tokenizer_files, token_dtype
from phalanx.errors import UserError
from phalanx.output_path import check_output_folder

SHARD_TOKENS = 2**28
"""A shard file closes once it holds this many tokens (512 MiB of uint16)."""
CHUNK_BYTES = 1 << 18
"""About this much text goes to a worker at a time: large enough to amortize the pickling,
small enough that the workers finish together (a last big chunk would keep one busy alone)."""

PIECE_CHARS = 1 << 20
"""A document longer than this (characters, or bytes for a byte tokenizer) is encoded in pieces
cut at the last line break before each 1 Mi mark (else the last space, else at the mark), their
tokens concatenated: a tokenizer's working memory grows with its input, many times its size.
The tokens differ from the whole document's only where the tokenizer would have
merged across such a break, which whitespace-splitting tokenizers never do."""

_worker_tokenizer: Tokenizer | None = None


def document_pieces(text: str | bytes, size: int = 0) -> list:
    """`text` cut into pieces of at most `size` (default PIECE_CHARS), each ending at a line
    break or space if one is in its second half."""
    size = size or PIECE_CHARS
    newline, space = ("\n", " ") if isinstance(text, str) else (b"\n", b" ")
    pieces, start = [], 0
    while len(text) - start > size:
        end = start + size
        cut = text.rfind(newline, start + size // 2, end)
        if cut < 0:
            cut = text.rfind(space, start + size // 2, end)
        end = cut + 1 if cut >= 0 else end
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


def _encode(tok: Tokenizer, texts: list) -> list[np.ndarray]:
    """encode_batch, with long documents encoded piece by piece (PIECE_CHARS)."""
    if all(len(text) <= PIECE_CHARS for text in texts):
        return tok.encode_batch(texts)
    # One piece at a time: a tokenizer's per-token records (offsets, strings) of a whole batch
    # of pieces would add up to the document's again; only the ids are kept.
    return [np.concatenate([tok.encode_batch([piece])[0] for piece in document_pieces(text)])
            if len(text) > PIECE_CHARS else tok.encode_batch([text])[0] for text in texts]


def _die_with_parent() -> None:
    """Linux: this worker gets SIGKILL when the parent dies (killed, or out of memory), instead
    of encoding on alone; elsewhere the pool's own shutdown is all there is."""
    try:
        # Imported when run, not at the top: the command's own code, which start-up need not load.
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call took effect
        os._exit(1)


def _clean_stale_staging(target: Path) -> None:
    """Remove staging folders earlier runs on this --out left when they were killed (their
    process is gone); a running one's is left alone."""
    for folder in target.parent.glob(f".{target.name}.tmp-*"):
        pid = folder.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def is_validation(position: int, val_fraction: float) -> bool:
    """Whether the document at `position` (0-based, over all sources) is held out."""
    digest = hashlib.blake2b(position.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def _chunks(files: list[Path], *, field: str, any_bytes: bool) -> Iterator[tuple[int, list, int]]:
    """(position of the first document, documents, source bytes) in order; empty documents skipped."""
    position, batch, text_bytes, source_bytes = 0, [], 0, 0
    for path in files:
        for text, used in documents(path, field=field, any_bytes=any_bytes):
            source_bytes += used
            if not text:
                continue
            batch.append(text)
            text_bytes += len(text)
            if text_bytes >= CHUNK_BYTES:
                yield position, batch, source_bytes
                position, batch, text_bytes, source_bytes = position + len(batch), [], 0, 0
    if batch or source_bytes:
        yield position, batch, source_bytes


def _init_worker(spec: str, forked: bool = False) -> None:
    global _worker_tokenizer
    if forked:
        _die_with_parent()
        # A forked worker inherits the parent's signal handlers: after PyTorch's elastic agent
        # ran in this process (a test session, a notebook), SIGTERM raises an exception that the
        # pool's task loop swallows, so Pool.terminate() would wait for it forever.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _worker_tokenizer = load_tokenizer(spec)


def _encode_chunk(task: tuple[int, list, int, float, str]) -> tuple[np.ndarray, np.ndarray, list, list, int]:
    """(train tokens, val tokens, train document lengths, val document lengths (each with its
    end-of-text token), source bytes) of one chunk."""
    position, texts, source_bytes, val_fraction, dtype = task
    tok = _worker_tokenizer
    eos = [] if tok.eos_id is None else [tok.eos_id]
    train, val = [], []
    for i, ids in enumerate(_encode(tok, texts)):
        split = val if is_validation(position + i, val_fraction) else train
        split += [ids, eos]
    join = lambda parts: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)  # noqa: E731
    lengths = lambda parts: [len(ids) + len(eos) for ids in parts[::2]]  # noqa: E731
    return join(train), join(val), lengths(train), lengths(val), source_bytes


class _ShardWriter:
    """Appends one split's tokens to `<split>_NNNNN.bin` files of about SHARD_TOKENS each."""
    def __init__(self, folder: Path, split: str):
        self.folder, self.split = folder, split
        self.shards: list[dict] = []
        self._file = None

    def write(self, tokens: np.ndarray) -> None:
        if not len(tokens):
            return
        if self._file is None or self.shards[-1]["tokens"] >= SHARD_TOKENS:
            self.close()
            self.shards.append({"file": f"{self.split}_{len(self.shards):05d}.bin", "tokens": 0})
            self._file = open(self.folder / self.shards[-1]["file"], "wb")
        tokens.tofile(self._file)
        self.shards[-1]["tokens"] += len(tokens)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)


def _ranges(shards: list[dict], start: int, stop: int) -> list[list]:
    """[file, start, stop] pieces covering tokens start..stop of the shards laid end to end."""
    pieces, offset = [], 0
    for shard in shards:
        lo, hi = max(start - offset, 0), min(stop - offset, shard["tokens"])
        if lo < hi:
            pieces.append([shard["file"], lo, hi])
        offset += shard["tokens"]
    return pieces


def _document_starts(lengths: list[int]) -> np.ndarray:
    """Where each document starts in its split's token sequence (int64)."""
    return np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype(np.int64) if lengths else np.zeros(0, np.int64)


def _split_record(train: _ShardWriter, val: _ShardWriter, counts: dict, val_fraction: float,
                  lengths: dict) -> tuple[dict, dict, str, dict]:
    """The train and val records of data.json, how the split was made, and each split's
    document starts."""
    if (train.tokens and val.tokens) or val_fraction == 0:
        return ({"documents": counts["train"], "tokens": train.tokens, "ranges": _ranges(train.shards, 0, train.tokens)},
                {"documents": counts["val"], "tokens": val.tokens, "ranges": _ranges(val.shards, 0, val.tokens)},
                "documents", {name: _document_starts(lengths[name]) for name in ("train", "val")})
    # Too few documents to split (one text file is one document), so all fell on one side:
    # hold out the last val_fraction of the tokens instead, so that both splits have data.
    whole = train if train.tokens else val
    cut = whole.tokens - math.ceil(whole.tokens * val_fraction)
    starts = _document_starts(lengths["train"] or lengths["val"])
    # The validation split starts inside the document that straddles the cut.
    val_starts = np.concatenate([[0], starts[starts > cut] - cut]).astype(np.int64)
    return ({"documents": counts["train"] + counts["val"], "tokens": cut, "ranges": _ranges(whole.shards, 0, cut)},
            {"documents": 0, "tokens": whole.tokens - cut, "ranges": _ranges(whole.shards, cut, whole.tokens)},
            "tail", {"train": starts[starts < cut], "val": val_starts})


def _target(out: str) -> Path:
    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(f"--out {out!r} already exists and is not an empty folder; choose another or remove it")
    return check_output_folder(target, "--out")


def prepare(sources: list[str], *, tokenizer: str, out: str, field: str = "text", val_fraction: float = 0.01,
            workers: int = 0, progress: bool = True) -> dict:
    """Write the prepared directory `out`; returns its data.json record."""
    # Imported when run, not at the top: it brings in tqdm, which start-up need not wait for.
    from tqdm import tqdm

    if not 0 <= val_fraction < 1:  # also nan
        raise UserError(f"--val-fraction {val_fraction} must be at least 0 and below 1")
    if not sources:
        raise UserError("give at least one source (text file, folder, .jsonl or .parquet)")
    target = _target(out)
    files = source_files(sources)
    tok = load_tokenizer(tokenizer or "bytes")
    dtype = token_dtype(tok.vocab_size)
    workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    target.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_staging(target)
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    began = time.perf_counter()
    try:
        writers = {"train": _ShardWriter(staging, "train"), "val": _ShardWriter(staging, "val")}
        counts = {"train": 0, "val": 0}
        lengths: dict[str, list[int]] = {"train": [], "val": []}
        tasks = ((p, texts, b, val_fraction, dtype.str) for p, texts, b in _chunks(files, field=field, any_bytes=tok.reads_any_bytes))
        bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc="prepare",
                   disable=not progress, smoothing=0.1)
        with _encoder(tokenizer or "bytes", workers) as encode:
            for train_ids, val_ids, train_lengths, val_lengths, used in encode(tasks):
                writers["train"].write(train_ids)
                writers["val"].write(val_ids)
                counts["train"] += len(train_lengths)
                counts["val"] += len(val_lengths)
                lengths["train"] += train_lengths
                lengths["val"] += val_lengths
                bar.update(used)
                bar.set_postfix(tokens=f"{writers['train'].tokens + writers['val'].tokens:,}", refresh=False)
        bar.close()
        for writer in writers.values():
            writer.close()
        if not counts["train"] + counts["val"]:
            raise UserError(f"no documents found in {', '.join(sources)} (empty files or field {field!r} always empty)")
        train, val, how, starts = _split_record(writers["train"], writers["val"], counts, val_fraction, lengths)
        for name, record in (("train", train), ("val", val)):
            record["document_starts"] = f"{name}_documents.npy"
            np.save(staging / record["document_starts"], starts[name])
        manifest = {
            "format": FORMAT,
            "tokenizer": {"name": tok.name, "file": save_tokenizer_files(tok, staging), "fingerprint": tok.fingerprint,
                          "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
            "dtype": dtype.name, "vocab_size": tok.vocab_size,
            "documents": counts["train"] + counts["val"],
            "tokens": writers["train"].tokens + writers["val"].tokens,
            "sources": [str(f) for f in files], "field": field, "val_fraction": val_fraction, "split_by": how,
            "shards": writers["train"].shards + writers["val"].shards,
            "train": train, "val": val,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if target.exists():
            target.rmdir()  # empty, checked above; rename cannot replace it on every platform
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    manifest["seconds"] = time.perf_counter() - began
    return manifest


class _encoder:
    """`with _encoder(spec, workers) as encode:` maps tasks to results in order, in this process
    (one worker) or a pool of forked ones."""
    def __init__(self, spec: str, workers: int):
        self.spec, self.workers, self.pool = spec, workers, None

    def __enter__(self):
        if self.workers == 1:
            _init_worker(self.spec)
            return lambda tasks: map(_encode_chunk, tasks)
        # Each worker is one core: the tokenizers library's own threads would oversubscribe.
        # The workers inherit the variable when they fork; this process keeps its setting.
        before = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
            self.pool = context.Pool(self.workers, initializer=_init_worker, initargs=(self.spec, True))
        finally:
            if before is None:
                os.environ.pop("TOKENIZERS_PARALLELISM")
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = before
        return self._in_order

    def _in_order(self, tasks):
        # Not Pool.imap: it reads its input as fast as it can, which would hold a whole
        # corpus in memory; here at most two chunks per worker are in flight.
        pending = collections.deque()
        for task in tasks:
            pending.append(self.pool.apply_async(_encode_chunk, (task,)))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
        return False
