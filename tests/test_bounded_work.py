"""Work bounded by what the input can mean (issue 25): absurd shapes refused up front with the
bound and why, blur's kernel and tiles bounded by the image, loads near the float limit placed
without inf or nan, and `phalanx prepare` holding one document's pieces, not the document,
with workers that die with their parent and stale staging folders cleaned."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from phalanx.cli import main
from phalanx.errors import UserError
from phalanx.testing.cli_errors import assert_cli_error


def test_a_model_of_a_trillion_layers_is_refused_at_once(tmp_path, capsys):
    model = tmp_path / "huge.json"
    model.write_text(json.dumps({"n_layers": 10**12, "dim": 64, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 128,
                                 "vocab_size": 256}))
    began = time.perf_counter()
    assert_cli_error(["plan", "--model", str(model), "--gpus", "8", "--global-batch", "64", "--seq-len", "1024"], capsys,
                     "about 4.1e+16 parameters is above 1e+15")
    assert time.perf_counter() - began < 60  # bound of the old behaviour (days), not a speed target


def test_parameter_bound_and_device_bound():
    from phalanx.model.config import ModelConfig
    from phalanx.planner.hardware import PRESETS

    with pytest.raises(UserError, match=r"about 1.1e\+16 parameters is above 1e\+15 \(what the largest clusters' memory holds for training\)$"):
        ModelConfig(n_layers=16000, dim=2**18, n_heads=2**10, n_kv_heads=2**10, ffn_dim=2**19, vocab_size=2**10)
    with pytest.raises(UserError, match="at most 1,048,576"):
        PRESETS["dgx-h100"].check_device_count(2**21)


def test_blur_sigma_beyond_the_image_is_refused_before_allocating(tmp_path, capsys):
    np.save(tmp_path / "in.npy", np.ones((64, 80), np.float32))
    assert_cli_error(["blur", str(tmp_path / "in.npy"), str(tmp_path / "out.npy"), "--sigma", "1e7"], capsys,
                     "--sigma 1e+07: a kernel radius of 40,000,000 pixels on a 64 x 80 image; at most 1,024")
    assert not (tmp_path / "out.npy").exists()


def test_blur_tiles_beyond_the_pixels_cut_once_per_pixel():
    from phalanx.kernels.gaussian_blur import blur

    image = np.random.default_rng(0).random((5, 7), dtype=np.float32)
    assert np.array_equal(blur(image, 1.0, tiles=10**15), blur(image, 1.0, tiles=7))


def _png16_rgb(path) -> None:
    """A 2 x 2 RGB PNG of 16 bits per channel (Pillow cannot write one)."""
    rows = b"".join(b"\0" + struct.pack(">6H", 1000, 2000, 3000, 65535, 0, 257) for _ in range(2))
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))  # noqa: E731
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 16, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def test_blur_warns_when_precision_is_lost(tmp_path, capsys):
    _png16_rgb(tmp_path / "deep.png")
    with pytest.raises(SystemExit) as exit_info:
        main(["blur", str(tmp_path / "deep.png"), str(tmp_path / "out.png"), "--sigma", "1"])
    assert exit_info.value.code == 0
    assert "has 16 bits per channel; Pillow reads its colour channels as 8 bits" in capsys.readouterr().err
    np.save(tmp_path / "unit.npy", np.random.default_rng(0).random((8, 8), dtype=np.float32))
    with pytest.raises(SystemExit) as exit_info:
        main(["blur", str(tmp_path / "unit.npy"), str(tmp_path / "unit.png"), "--sigma", "1"])
    assert exit_info.value.code == 0
    assert "the values are within [0, 1]; .png stores whole numbers 0 to 255" in capsys.readouterr().err


def test_balance_loads_near_the_float_limit_give_finite_figures(tmp_path, capsys):
    """Scaled by a power of two before placing: the same placement as the loads / 2**1000."""
    load = np.array([[1.7e308, 1.7e308, 1.7e308, 1.0], [1.0, 1.0, 1.0, 9.0]])
    (tmp_path / "huge.json").write_text(json.dumps(load.tolist()))
    (tmp_path / "small.json").write_text(json.dumps((load / 2**1020).tolist()))
    records = []
    for name in ("huge", "small"):
        with pytest.raises(SystemExit) as exit_info:
            main(["balance", "--load", str(tmp_path / f"{name}.json"), "--replicas", "8", "--gpus", "4", "--json"])
        assert exit_info.value.code == 0
        records.append(json.loads(capsys.readouterr().out))
    huge, small = records
    assert all(np.isfinite(huge["balancedness"]["per_layer"])) and all(np.isfinite(huge["imbalance"]["per_layer"]))
    assert huge["phy2log"] == small["phy2log"]


def test_a_long_document_is_encoded_in_pieces(tmp_path, monkeypatch):
    """No tokenizer call sees more than PIECE_CHARS, and the tokens are those of the whole
    (a byte tokenizer merges nothing across a line break)."""
    from phalanx.data import prepare as prepare_module
    from phalanx.data.prepare import document_pieces, prepare
    from phalanx.data.prepared import open_prepared
    from phalanx.data.tokenizer import ByteTokenizer

    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 1000)
    text = "".join(f"line {i} of a long document\n" for i in range(400))  # 11 kB
    pieces = document_pieces(text, 1000)
    assert "".join(pieces) == text and max(map(len, pieces)) <= 1000 and all(p.endswith("\n") for p in pieces[:-1])
    seen = []
    original = ByteTokenizer.encode_batch
    monkeypatch.setattr(ByteTokenizer, "encode_batch", lambda self, texts: seen.extend(map(len, texts)) or original(self, texts))
    (tmp_path / "doc.jsonl").write_text(json.dumps({"text": text}) + "\n")
    prepare([str(tmp_path / "doc.jsonl")], tokenizer="bytes", out=str(tmp_path / "out"), workers=1, progress=False,
            val_fraction=0)
    assert max(seen) <= 1000
    tokens = np.concatenate([np.asarray(open_prepared(tmp_path / "out").train)])
    assert bytes(tokens[: len(text)].astype(np.uint8)) == text.encode()


def test_a_document_beyond_the_bound_is_refused_naming_its_size(tmp_path, monkeypatch, capsys):
    from phalanx.data import sources

    monkeypatch.setattr(sources, "MAX_DOCUMENT_BYTES", 2**20)
    (tmp_path / "big.jsonl").write_text('{"text": "a"}\n' + json.dumps({"text": "x" * 2**21}) + "\n")
    assert_cli_error(["prepare", str(tmp_path / "big.jsonl"), "--tokenizer", "bytes", "--out", str(tmp_path / "out"),
                      "--workers", "1", "--no-progress"], capsys, "line 2: a document of 1 MiB or more; at most 1 MiB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


def test_prepare_cleans_stale_staging_and_skips_prepared_outputs(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello phalanx. " * 50)
    stale = tmp_path / ".out.tmp-999999999"  # left by a killed run: no such process
    stale.mkdir()
    argv = ["prepare", str(corpus), "--tokenizer", "bytes", "--workers", "1", "--no-progress"]
    for out in ("first", "out"):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--out", str(corpus / out if out == "first" else tmp_path / out)])
        assert exit_info.value.code == 0
    assert not stale.exists()
    err = capsys.readouterr().err
    assert f"skipping {corpus / 'first'}: it is a prepared directory" in err
    record = json.loads((tmp_path / "out" / "data.json").read_text())
    assert record["documents"] == 1 and record["sources"] == [str(corpus / "a.txt")]


WORKERS_SCRIPT = """
import sys, time
from phalanx.data.prepare import _encoder
with _encoder("bytes", 2) as encode:
    print(" ".join(str(p.pid) for p in encode.__self__.pool._pool), flush=True)
    time.sleep(60)
"""


def test_prepare_workers_die_with_their_parent():
    parent = subprocess.Popen([sys.executable, "-c", WORKERS_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(workers) == 2
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers)
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has died
    except FileNotFoundError:
        return False
