"""Prepared data and text tokenizers in training: prepare -> train -> resume reads the batches
of an uninterrupted run; data a run cannot use is refused before any worker starts, in one
line, with no run folder left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from phalanx.cli import main
from phalanx.data.batches import rank_batch
from phalanx.data.corpus import load_corpus, open_training_data
from phalanx.data.prepare import prepare
from phalanx.data.tokenizer import load_tokenizer
from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.tokenizers import sample_text, train_bpe
from phalanx.train.loop import train
from phalanx.testing.cli_errors import assert_cli_error

TINY = ["--model", "tiny", "--steps", "2", "--global-batch", "4", "--seq-len", "16", "--no-progress", "--no-plot",
        "--sample-tokens", "0", "--nproc", "1"]


@pytest.fixture
def bpe(tmp_path):
    """A BPE of vocabulary <= 200, so the byte-sized `tiny` model (vocabulary 256) can train on it."""
    return str(train_bpe(tmp_path / "tok" / "tokenizer.json", vocab_size=200))


@pytest.fixture
def prepared(tmp_path, bpe):
    docs = [sample_text(60, seed=i) for i in range(80)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(tmp_path / "docs.jsonl")], tokenizer=bpe, out=str(tmp_path / "prepared"), val_fraction=0.1,
            workers=1, progress=False)
    return tmp_path / "prepared"


def _losses(cfg):
    return train(cfg, Path(cfg.out)).losses


def test_prepared_batches_are_a_function_of_seed_and_step(prepared):
    """Two opens of the directory (a run and its resumption) give the same batches, and they
    are windows of the shard as written."""
    first, again = load_corpus(str(prepared), load_tokenizer(str(prepared))), open_training_data(
        data=str(prepared), tokenizer="", model="tiny")  # the run's tokenizer defaults to the data's
    assert isinstance(first.train, np.memmap)
    on_disk = np.fromfile(prepared / "train_00000.bin", dtype=np.uint16).astype(np.int64)
    for step in range(4):
        a = rank_batch(first.train, seed=3, step=step, global_batch=8, seq_len=32, dp_rank=1, dp_size=2)
        b = rank_batch(again.train, seed=3, step=step, global_batch=8, seq_len=32, dp_rank=1, dp_size=2)
        assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a, b))
        row = a[0][0].numpy()
        assert any(np.array_equal(on_disk[s : s + 32], row) for s in range(len(on_disk) - 32))


def test_prepare_train_resume_equals_uninterrupted(tiny_config, prepared):
    """As tests/test_resume.py, on a prepared directory: exact within one layout."""
    cfg = tiny_config.replace(data=str(prepared), steps=4, ckpt_every=2, eval_every=2)
    full = run_ranks(1, _losses, cfg)[0]
    run = Path(cfg.out)
    assert (run / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    for path in (run / "checkpoints").glob("step_*"):
        if json.loads((path / "phalanx.json").read_text())["step"] > 2:
            shutil.rmtree(path)
    resumed = run_ranks(1, _losses, cfg.replace(resume=True))[0]
    assert resumed == full[2:]
    assert full[-1] < full[0]


def test_text_file_with_text_tokenizer(tmp_path, bpe):
    """Text given to --data is tokenized on the fly with --tokenizer: each file a document
    followed by the end-of-text token."""
    (tmp_path / "d").mkdir()
    texts = [sample_text(300, seed=i) for i in range(3)]
    for i, text in enumerate(texts):
        (tmp_path / "d" / f"{i}.txt").write_text(text)
    corpus = open_training_data(data=str(tmp_path / "d"), tokenizer=bpe, model="tiny")
    tok = corpus.tokenizer
    whole = np.concatenate([np.concatenate([tok.encode(t), [tok.eos_id]]) for t in texts])
    assert np.array_equal(np.concatenate([corpus.train, corpus.val]), whole)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *TINY, "--data", str(tmp_path / "d"), "--tokenizer", bpe, "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 0 and (tmp_path / "r" / "tokenizer.json").exists()


def _fails(argv, capsys, message, run):
    assert_cli_error(argv, capsys, message)
    assert not run.exists()  # found before the run folder was made


def test_invalid_utf8_with_text_tokenizer(tmp_path, bpe, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(("caf\xe9 " * 200).encode("latin-1"))
    _fails(["train", *TINY, "--data", str(bad), "--tokenizer", bpe, "--out", str(tmp_path / "r")], capsys,
           f"{bad} is not UTF-8 text", tmp_path / "r")


def test_validation_split_too_short(tmp_path, bpe, capsys):
    (tmp_path / "one.txt").write_text(sample_text(300, seed=1))
    prepare([str(tmp_path / "one.txt")], tokenizer=bpe, out=str(tmp_path / "p"), val_fraction=0.05, workers=1, progress=False)
    manifest = json.loads((tmp_path / "p" / "data.json").read_text())
    train_tokens, val_tokens = manifest["train"]["tokens"], manifest["val"]["tokens"]
    assert val_tokens < 66 < train_tokens
    _fails(["train", *TINY, "--seq-len", "64", "--data", str(tmp_path / "p"), "--out", str(tmp_path / "r")], capsys,
           f"the validation split holds {val_tokens:,} tokens (train {train_tokens:,}, validation {val_tokens:,}), "
           "fewer than seq_len + 2 = 66", tmp_path / "r")
    (tmp_path / "short.txt").write_text("x" * 300)  # bytes: the last 15 of 300 tokens are validation
    _fails(["train", *TINY, "--data", str(tmp_path / "short.txt"), "--out", str(tmp_path / "r")], capsys,
           "the validation split holds 15 tokens (train 285, validation 15), fewer than seq_len + 2 = 18", tmp_path / "r")
    # Without evaluation the validation split is not needed: the same data trains.
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *TINY, "--seq-len", "64", "--eval-every", "0", "--data", str(tmp_path / "p"), "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 0


def test_tokenizer_larger_than_model(tmp_path, capsys):
    big = train_bpe(tmp_path / "big.json", vocab_size=300, byte_alphabet=True)
    (tmp_path / "t.txt").write_text(sample_text(500, seed=2))
    _fails(["train", *TINY, "--data", str(tmp_path / "t.txt"), "--tokenizer", str(big), "--out", str(tmp_path / "r")],
           capsys, f"has a vocabulary of {load_tokenizer(str(big)).vocab_size} tokens, more than model 'tiny''s 256",
           tmp_path / "r")


def test_broken_or_mismatched_prepared_dir(tmp_path, prepared, capsys):
    other = train_bpe(tmp_path / "other.json", vocab_size=180, texts=[sample_text(100, seed=50)])
    _fails(["train", *TINY, "--data", str(prepared), "--tokenizer", str(other), "--out", str(tmp_path / "r")], capsys,
           "was prepared with tokenizer", tmp_path / "r")
    manifest = json.loads((prepared / "data.json").read_text())
    (prepared / "data.json").write_text(json.dumps({**manifest, "shards": [{"file": "train_00000.bin", "tokens": 1}]}))
    _fails(["train", *TINY, "--data", str(prepared), "--out", str(tmp_path / "r")], capsys,
           "train_00000.bin: missing or not 1 uint16 tokens", tmp_path / "r")
    (prepared / "data.json").write_text("{ not json")
    _fails(["train", *TINY, "--data", str(prepared), "--out", str(tmp_path / "r")], capsys,
           "data.json is not readable JSON", tmp_path / "r")


def test_failed_worker_leaves_no_run_folder(tmp_path, tiny_config, monkeypatch):
    """A run that fails before writing anything removes the folder this launch made, never
    one that was there before."""
    import phalanx.train.launch as launch

    monkeypatch.setattr(launch, "worker_main", lambda cfg_fields, run_dir, job=None: 2)
    cfg = tiny_config.replace(nproc=1)
    assert launch.launch_train(cfg) == 2
    assert not Path(cfg.out).exists()
    Path(cfg.out).mkdir()
    assert launch.launch_train(cfg) == 2
    assert Path(cfg.out).is_dir()  # the user's folder stays


def _model_dir(folder: Path, tokenizer_vocab: int) -> Path:
    """A Hugging Face model directory (config.json, no weights: random init) with a tokenizer.json."""
    import transformers

    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64).save_pretrained(folder)
    train_bpe(folder / "tokenizer.json", vocab_size=tokenizer_vocab, byte_alphabet=tokenizer_vocab > 256)
    return folder


def test_model_directory_tokenizer_is_the_default(tmp_path, capsys):
    model = _model_dir(tmp_path / "model", 200)
    (tmp_path / "t.txt").write_text(sample_text(2000, seed=3))
    corpus = open_training_data(data=str(tmp_path / "t.txt"), tokenizer="", model=str(model))
    assert corpus.tokenizer.source == model / "tokenizer.json"
    assert open_training_data(data=str(tmp_path / "t.txt"), tokenizer="bytes", model=str(model)).tokenizer.name == "bytes"
    big = _model_dir(tmp_path / "big", 300)
    _fails(["train", *TINY[2:], "--model", str(big), "--init", "random", "--data", str(tmp_path / "t.txt"), "--out", str(tmp_path / "r")],
           capsys, f"more than model {str(big)!r}'s 256", tmp_path / "r")
