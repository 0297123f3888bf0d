"""`phalanx export RUN_DIR OUT_DIR`: a trained run's checkpoint as a directory `transformers`
loads, with the same logits (rtol = atol = 1e-4, fp32: see tests/test_hf_models.py), and the
tokenizer the run used (for a byte-level run, one that maps byte i to id i)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx.cli import main
from phalanx.hf.export_run import find_checkpoint, load_checkpoint_model
from phalanx.model.config import ModelConfig
from phalanx.train.loop import train
from tests.hf_models import hf_logits

transformers = pytest.importorskip("transformers")
TOL = dict(rtol=1e-4, atol=1e-4)


def _trained_logits(run: Path, tokens: torch.Tensor) -> torch.Tensor:
    path, meta = find_checkpoint(run, None)
    with torch.no_grad():
        return load_checkpoint_model(path, ModelConfig.from_dict(meta["model"]))(tokens)


def test_byte_level_run_exports_with_a_byte_tokenizer(tiny_config, tmp_path):
    run = Path(tiny_config.out)
    train(tiny_config.replace(steps=2, ckpt_every=1), run)
    assert main_status(["export", str(run), str(tmp_path / "hf"), "--step", "1"]) == 0
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = _trained_logits(run, tokens)  # the newest checkpoint: step 2
    main_status(["export", str(run), str(tmp_path / "hf2")])
    torch.testing.assert_close(hf_logits(tmp_path / "hf2", tokens), expected, **TOL)
    assert not torch.allclose(hf_logits(tmp_path / "hf", tokens), expected, **TOL)  # --step 1 is another state
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf2")
    text = "héllo\n\x00 wörld"
    assert tokenizer(text)["input_ids"] == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text


def test_run_with_a_text_tokenizer_exports_it(tiny_config, tmp_path):
    from phalanx.testing.tokenizers import sample_text, train_bpe

    bpe = train_bpe(tmp_path / "tok" / "tokenizer.json", vocab_size=200, texts=[sample_text(2000, 0)])
    data = tmp_path / "text.txt"
    data.write_text(sample_text(20000, 1))
    run = Path(tiny_config.out)
    train(tiny_config.replace(steps=1, data=str(data), tokenizer=str(bpe)), run)
    main_status(["export", str(run), str(tmp_path / "hf")])
    assert json.loads((tmp_path / "hf" / "tokenizer.json").read_text()) == json.loads(bpe.read_text())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 0  # <|endoftext|>
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {"eos_token_id": 0}


def test_export_records_every_end_of_sequence_id(tmp_path):
    """A tokenizer whose tokenizer_config.json names an end-of-turn token (an instruct model's
    <|im_end|>): generation_config.json lists it beside the end-of-text id, so transformers,
    vLLM and phalanx serve all stop on either."""
    import shutil

    from phalanx.hf.export_run import _eos
    from phalanx.testing.tokenizers import sample_text, train_bpe

    bpe = train_bpe(tmp_path / "tok" / "tokenizer.json", vocab_size=200, texts=[sample_text(2000, 0)])
    vocab = json.loads(bpe.read_text())["model"]["vocab"]
    turn_end = next(token for token, index in vocab.items() if index == 50)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": turn_end}))
    assert _eos([bpe]) == (0, [0, 50])
    (tmp_path / "alone").mkdir()
    shutil.copy(bpe, tmp_path / "alone" / "tokenizer.json")
    assert _eos([tmp_path / "alone" / "tokenizer.json"]) == (0, [0])


def main_status(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code
