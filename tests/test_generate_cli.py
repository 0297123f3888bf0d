"""`phalanx generate`: the --json output (same ids as the library, in one process and over two
launched tp workers), a run directory, and bad input as one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import phalanx.hf as hf
from phalanx.cli import main
from phalanx.inference.decoding import generate_ids
from phalanx.inference.sampling import Sampling
from tests.hf_models import write_checkpoint, write_word_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gen") / "hf", "llama")


def _cli(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_json_output_matches_the_library(capsys, checkpoint):
    code, out, _ = _cli(capsys, "--model", checkpoint, "--prompt-ids", "1,2,3", "--greedy", "--max-new-tokens", 6, "--json")
    assert code == 0
    record = json.loads(out)
    assert list(record) == ["new_ids", "text", "prefill_s", "decode_tokens_per_s"]
    expected = generate_ids(hf.load(checkpoint), [1, 2, 3], max_new_tokens=6, max_len=128, sampling=Sampling(greedy=True))
    assert record["new_ids"] == expected.new_ids
    assert record["text"] == bytes(expected.new_ids).decode("utf-8", errors="replace")  # no tokenizer.json: bytes
    assert record["prefill_s"] > 0 and record["decode_tokens_per_s"] > 0


def test_sampled_by_default_and_seeded(capsys, checkpoint):
    argv = ["--model", checkpoint, "--prompt-ids", "4,5", "--max-new-tokens", 8, "--json"]
    runs = [json.loads(_cli(capsys, *argv, "--seed", seed)[1])["new_ids"] for seed in (1, 1, 2)]
    expected = generate_ids(hf.load(checkpoint), [4, 5], max_new_tokens=8, max_len=128,
                            sampling=Sampling(temperature=0.8, top_k=40, seed=1)).new_ids
    assert runs[0] == runs[1] == expected
    assert runs[2] != runs[0]


def test_two_tp_workers_print_what_one_process_prints(capfd, checkpoint):
    """capfd: the launched workers print to the inherited file descriptor."""
    argv = ["--model", checkpoint, "--prompt-ids", "7,8,9,10", "--max-new-tokens", 5, "--json"]
    single = json.loads(_cli(capfd, *argv)[1])
    code, out, _ = _cli(capfd, *argv, "--nproc", 2, "--plan", "tp=2")
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1, "only rank 0 prints"
    assert json.loads(lines[0])["new_ids"] == single["new_ids"]


def test_run_directory(capsys, tmp_path, checkpoint):
    from phalanx.checkpoint.store import save_checkpoint

    model = hf.load(checkpoint)
    save_checkpoint(tmp_path / "run", 3, model, torch.optim.AdamW(model.parameters()), rank=0, keep=1,
                    meta={"model": model.cfg.to_dict(), "train": {"model": str(checkpoint)}})
    argv = ["--prompt-ids", "1,2,3", "--greedy", "--max-new-tokens", 4, "--json"]
    from_run = json.loads(_cli(capsys, "--model", tmp_path / "run", *argv)[1])
    from_dir = json.loads(_cli(capsys, "--model", checkpoint, *argv)[1])
    assert from_run["new_ids"] == from_dir["new_ids"]
    code, _, err = _cli(capsys, "--model", tmp_path / "run", "--step", 9, *argv)
    assert code == 2 and "has no checkpoint of step 9; it has steps 3" in err


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "hi", "--prompt-ids", "1"], "exactly one of --prompt TEXT and --prompt-ids"),
    ([], "exactly one of --prompt TEXT and --prompt-ids"),
    (["--prompt-ids", "1,x"], "--prompt-ids takes comma-separated token ids"),
    (["--prompt-ids", "1,96"], "prompt token id 96 is outside the model's vocabulary (0 to 95)"),
    (["--prompt-ids", "-1"], "prompt token id -1 is outside"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--prompt-ids", "1", "--max-new-tokens", "128"], "1 tokens + 128 new tokens = 129 positions exceeds the model's context of 128"),
    (["--prompt-ids", "1", "--temperature", "0"], "--temperature must be > 0"),
    (["--prompt-ids", "1", "--top-k", "-3"], "--top-k must be >= 0"),
    (["--prompt-ids", "1", "--top-p", "2"], "--top-p must be in (0, 1]"),
    (["--prompt-ids", "1", "--greedy", "--top-k", "5"], "cannot be combined with --top-k"),
    (["--prompt-ids", "1", "--step", "3"], "--step is for run directories"),
    (["--prompt-ids", "1", "--nproc", "2", "--plan", "pp=2"], "runs tensor-parallel layouts (tp=N, optionally sp=true); plan pp=2 has dp=1, pp=2"),
    (["--prompt-ids", "1", "--nproc", "2", "--plan", "dp=2"], "has dp=2, pp=1"),
    (["--prompt-ids", "1", "--nproc", "2", "--plan", "tp=3"], None),
])
def test_bad_input_is_a_one_line_error(capsys, checkpoint, argv, message):
    code, out, err = _cli(capsys, "--model", checkpoint, *argv)
    assert code == 2 and out == ""
    assert err.startswith("phalanx: error: ") and err.count("\n") == 1
    if message:
        assert message in err


def test_models_without_weights(capsys, tmp_path):
    code, _, err = _cli(capsys, "--model", "tiny", "--prompt-ids", "1")
    assert code == 2 and "'tiny' is a preset without weights" in err
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((write_checkpoint(tmp_path / "w", "llama") / "config.json").read_text())
    code, _, err = _cli(capsys, "--model", tmp_path / "cfg", "--prompt-ids", "1")
    assert code == 2 and "has no weights (*.safetensors or pytorch_model.bin)" in err


def test_cli_start_imports_no_torch():
    code = "import sys, phalanx.cli; phalanx.cli.build_parser(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tokenizer_json_encodes_the_prompt_and_its_eos_stops(capsys, tmp_path):
    """A model directory's tokenizer.json encodes --prompt, decodes the new ids, and the
    eos_token of its tokenizer_config.json ends generation (kept as the last new id)."""
    folder = write_checkpoint(tmp_path / "hf", "llama")
    write_word_tokenizer(folder, 96)
    free_run = generate_ids(hf.load(folder), [3, 1, 4], max_new_tokens=12, max_len=128, sampling=Sampling(greedy=True)).new_ids
    eos = free_run[4]
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{eos}"}))
    code, out, _ = _cli(capsys, "--model", folder, "--prompt", "w3 w1 w4", "--greedy", "--max-new-tokens", 12, "--json")
    record = json.loads(out)
    assert code == 0
    assert record["new_ids"] == free_run[:free_run.index(eos) + 1]
    assert record["text"] == " ".join(f"w{i}" for i in record["new_ids"])
