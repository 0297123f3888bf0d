"""Tokenizers: round trips, the end-of-text token, how a tokenizer is found, token dtypes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from phalanx.data.tokenizer import (
    ByteTokenizer, HFTokenizer, decode, encode, load_tokenizer, token_dtype,
)
from phalanx.errors import UserError
from phalanx.testing.tokenizers import sample_text, train_bpe


def test_bytes_round_trip_and_any_bytes():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓"
    assert tok.encode(text).tolist() == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    raw = bytes(range(256))
    assert tok.encode(raw).tolist() == list(range(256))  # any file is data
    assert decode(encode(text)) == text  # the module functions callers used before
    assert tok.vocab_size == 256 and tok.eos_id is None


def test_bpe_round_trip_and_eos(tmp_path):
    path = train_bpe(tmp_path / "tok" / "tokenizer.json", vocab_size=200)
    tok = load_tokenizer(str(path))
    text = sample_text(40, seed=99)
    ids = tok.encode(text)
    assert 0 < len(ids) < len(text)  # merges happened: fewer tokens than characters
    assert tok.decode(ids) == text
    assert all(a.tolist() == tok.encode(t).tolist() for a, t in zip(tok.encode_batch([text, "the dog"]), [text, "the dog"]))
    vocab = json.loads(path.read_text())["model"]["vocab"]
    assert tok.vocab_size == max(vocab.values()) + 1 <= 200
    assert tok.eos_id == 0  # <|endoftext|>, the first special token
    assert tok.fingerprint.startswith("sha256:")


def test_eos_from_tokenizer_config(tmp_path):
    """A tokenizer without a known end-of-text name takes the eos_token of tokenizer_config.json."""
    path = train_bpe(tmp_path / "tokenizer.json", vocab_size=120, end_token="[DOC_END]")
    assert load_tokenizer(str(path)).eos_id is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "[DOC_END]"}}))
    assert load_tokenizer(str(path)).eos_id == 0


def test_resolution_order(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert isinstance(load_tokenizer("", model), ByteTokenizer)  # no tokenizer.json: bytes
    train_bpe(model / "tokenizer.json", vocab_size=150)
    assert isinstance(load_tokenizer("", model), HFTokenizer)  # the model directory's
    assert isinstance(load_tokenizer("bytes", model), ByteTokenizer)  # --tokenizer bytes overrides
    assert load_tokenizer(str(model)).source == model / "tokenizer.json"  # a folder holding one


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(UserError, match="cannot read tokenizer"):
        load_tokenizer(str(tmp_path))


def test_token_dtype_by_vocabulary():
    assert token_dtype(256) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535 fit
    assert token_dtype(65537) == np.uint32
    assert token_dtype(128256) == np.uint32  # Llama 3
