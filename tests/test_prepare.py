"""`phalanx prepare`: what it writes equals the sources tokenized one by one, whatever the
number of workers; sharded splits read back as one sequence; bad input is one line and leaves
nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from phalanx.cli import main
from phalanx.data.batches import rank_batch
from phalanx.data.prepare import prepare
from phalanx.data.prepared import TokenRanges, open_prepared
from phalanx.data.tokenizer import load_tokenizer
from phalanx.testing.tokenizers import sample_text, train_bpe
from phalanx.testing.cli_errors import assert_cli_error


@pytest.fixture
def bpe(tmp_path):
    return str(train_bpe(tmp_path / "tok" / "tokenizer.json", vocab_size=200))


def _sources(root):
    """A folder of two text files, a JSONL (with a blank line) and a parquet file; their
    documents in the order prepare must read them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [sample_text(30 + 7 * i, seed=i) for i in range(9)]
    (root / "folder").mkdir(parents=True)
    (root / "folder" / "b.txt").write_text(docs[1])
    (root / "folder" / "a.txt").write_text(docs[0])  # sorted: a.txt first
    (root / "folder" / "skip.bin").write_bytes(b"\xff\x00")  # not a text suffix: not read
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs[2:5])]
    (root / "d.jsonl").write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    pq.write_table(pa.table({"id": list(range(4)), "body": docs[5:9]}), root / "e.parquet")
    return [str(root / "folder"), str(root / "d.jsonl"), str(root / "e.parquet")], docs


def _reference(tok, docs):
    return np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in docs])


def test_prepare_all_source_kinds_equal_tokenizing_each_document(tmp_path, bpe):
    sources, docs = _sources(tmp_path / "src")
    # The JSONL's field and the parquet's column differ: prepare them as two runs.
    tok = load_tokenizer(bpe)
    one = prepare(sources[:2], tokenizer=bpe, out=str(tmp_path / "a"), val_fraction=0, workers=1, progress=False)
    two = prepare(sources[2:], tokenizer=bpe, out=str(tmp_path / "b"), field="body", val_fraction=0, workers=2, progress=False)
    assert (one["documents"], two["documents"]) == (5, 4)
    assert one["dtype"] == "uint16" and one["vocab_size"] == tok.vocab_size
    for out, expected in (("a", docs[:5]), ("b", docs[5:])):
        data = open_prepared(tmp_path / out)
        assert np.array_equal(np.asarray(data.train), _reference(tok, expected))
        assert len(data.val) == 0
        assert (tmp_path / out / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()


def test_split_is_by_document_and_independent_of_workers(tmp_path, bpe):
    docs = [sample_text(20, seed=100 + i) for i in range(60)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    outs = []
    for workers in (1, 2):
        manifest = prepare([str(tmp_path / "docs.jsonl")], tokenizer=bpe, out=str(tmp_path / f"w{workers}"),
                           val_fraction=0.25, workers=workers, progress=False)
        outs.append(open_prepared(tmp_path / f"w{workers}"))
    assert np.array_equal(np.asarray(outs[0].train), np.asarray(outs[1].train))
    assert np.array_equal(np.asarray(outs[0].val), np.asarray(outs[1].val))
    tok = load_tokenizer(bpe)

    def split_docs(tokens):  # decode each eos-terminated document
        ends = np.flatnonzero(np.asarray(tokens) == tok.eos_id)
        return [tok.decode(part) for part in np.split(np.asarray(tokens), ends + 1)[:-1] for part in [part[:-1]]]

    train_docs, val_docs = split_docs(outs[0].train), split_docs(outs[0].val)
    assert manifest["split_by"] == "documents"
    assert (len(train_docs), len(val_docs)) == (manifest["train"]["documents"], manifest["val"]["documents"])
    assert 5 <= len(val_docs) <= 25  # about a quarter of 60
    # Every document lands whole on one side, each side keeping the input order.
    assert sorted(train_docs + val_docs) == sorted(docs)
    assert train_docs == [d for d in docs if d in set(train_docs)]
    assert val_docs == [d for d in docs if d in set(val_docs)]


def test_one_document_holds_out_its_tail(tmp_path, bpe):
    (tmp_path / "one.txt").write_text(sample_text(400, seed=5))
    manifest = prepare([str(tmp_path / "one.txt")], tokenizer=bpe, out=str(tmp_path / "p"), val_fraction=0.1,
                       workers=1, progress=False)
    data = open_prepared(tmp_path / "p")
    total = manifest["tokens"]
    assert manifest["split_by"] == "tail"
    assert len(data.val) == -(-total // 10) and len(data.train) + len(data.val) == total
    (shard,) = manifest["shards"]
    whole = np.fromfile(tmp_path / "p" / shard["file"], dtype=np.uint16)
    assert np.array_equal(np.concatenate([data.train, data.val]), whole)


def test_shards_read_as_one_sequence(tmp_path, bpe, monkeypatch):
    """Tiny shards: a split spans many files, and windows across their seams read the same
    tokens, so batches equal those of one contiguous array."""
    import phalanx.data.prepare as prepare_module

    monkeypatch.setattr(prepare_module, "SHARD_TOKENS", 50)
    monkeypatch.setattr(prepare_module, "CHUNK_BYTES", 100)
    docs = [sample_text(15, seed=i) for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    manifest = prepare([str(tmp_path / "d.jsonl")], tokenizer=bpe, out=str(tmp_path / "p"), val_fraction=0,
                       workers=1, progress=False)
    assert len(manifest["shards"]) > 5
    data = open_prepared(tmp_path / "p")
    assert isinstance(data.train, TokenRanges)
    whole = _reference(load_tokenizer(bpe), docs)
    assert len(data.train) == len(whole)
    for start, stop in ((0, 10), (45, 120), (49, 51), (len(whole) - 7, len(whole))):
        assert np.array_equal(data.train[start:stop], whole[start:stop])
    for step in range(3):
        got = rank_batch(data.train, seed=1, step=step, global_batch=4, seq_len=16, dp_rank=0, dp_size=1)
        want = rank_batch(whole, seed=1, step=step, global_batch=4, seq_len=16, dp_rank=0, dp_size=1)
        assert all(np.array_equal(g.numpy(), w.numpy()) for g, w in zip(got, want))


def test_uint32_shards_read_back(tmp_path):
    """A vocabulary over 65,536 stores uint32: ids above 65,535 come back intact."""
    ids = np.array([5, 70000, 128255, 1, 65536], dtype=np.uint32)
    ids.tofile(tmp_path / "train_00000.bin")
    (tmp_path / "data.json").write_text(json.dumps({
        "format": "phalanx-prepared-v1", "dtype": "uint32", "vocab_size": 128256,
        "tokenizer": {"name": "t", "file": None, "fingerprint": "bytes", "vocab_size": 128256, "eos_id": None},
        "shards": [{"file": "train_00000.bin", "tokens": 5}],
        "train": {"documents": 1, "tokens": 3, "ranges": [["train_00000.bin", 0, 3]]},
        "val": {"documents": 0, "tokens": 2, "ranges": [["train_00000.bin", 3, 5]]},
    }))
    data = open_prepared(tmp_path)
    assert np.asarray(data.train).tolist() == [5, 70000, 128255] and np.asarray(data.val).tolist() == [1, 65536]


def test_bytes_tokenizer_takes_any_file(tmp_path):
    (tmp_path / "raw.txt").write_bytes(b"\xff\xfe not utf-8 \x00")
    prepare([str(tmp_path / "raw.txt")], tokenizer="bytes", out=str(tmp_path / "p"), val_fraction=0, workers=1, progress=False)
    assert np.asarray(open_prepared(tmp_path / "p").train).tobytes() == np.frombuffer(
        b"\xff\xfe not utf-8 \x00", np.uint8).astype(np.uint16).tobytes()


def _fails(argv, capsys, message, out):
    assert_cli_error(argv, capsys, message, ignore=("prepare:",))
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))  # nothing half written


def test_bad_sources(tmp_path, bpe, capsys):
    out = tmp_path / "out"
    args = ["--tokenizer", bpe, "--out", str(out), "--workers", "1", "--no-progress"]
    (tmp_path / "empty.jsonl").write_text("")
    _fails(["prepare", str(tmp_path / "empty.jsonl"), *args], capsys, "no documents found", out)
    (tmp_path / "nofield.jsonl").write_text('{"text": "the dog"}\n{"body": "the fox"}\n')
    _fails(["prepare", str(tmp_path / "nofield.jsonl"), *args], capsys, f"{tmp_path / 'nofield.jsonl'}, line 2: has no field 'text'", out)
    (tmp_path / "bad.jsonl").write_text('{"text": "the dog"}\n{"text": \n')
    _fails(["prepare", str(tmp_path / "bad.jsonl"), *args], capsys, "bad.jsonl, line 2: not valid JSON", out)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    _fails(["prepare", str(tmp_path / "latin1.txt"), *args], capsys, f"{tmp_path / 'latin1.txt'} is not UTF-8 text", out)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["the dog"]}), tmp_path / "t.parquet")
    _fails(["prepare", str(tmp_path / "t.parquet"), *args], capsys, "has no column 'text' (columns: body", out)
    _fails(["prepare", str(tmp_path / "missing.txt"), *args], capsys, "does not exist", out)
    (tmp_path / "ok.txt").write_text("the dog")
    _fails(["prepare", str(tmp_path / "ok.txt"), *args, "--val-fraction", "1"], capsys, "must be at least 0 and below 1", out)
    # The error comes from a worker process: same one line, nothing written.
    (tmp_path / "many.jsonl").write_text('{"text": "the dog"}\n' * 50 + '{"txt": 1}\n')
    _fails(["prepare", str(tmp_path / "many.jsonl"), *args[:-3], "--workers", "2", "--no-progress"], capsys, "line 51", out)


def test_out_must_be_new_or_empty(tmp_path, bpe, capsys):
    (tmp_path / "ok.txt").write_text("the dog")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", str(tmp_path / "ok.txt"), "--tokenizer", bpe, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "already exists" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_prepare_does_not_import_torch():
    code = ("import sys, phalanx.data.prepare, phalanx.data.prepared, phalanx.data.corpus, phalanx.data.cli; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
