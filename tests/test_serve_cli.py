"""`phalanx serve`'s flags: each mistake one line (exit 2) before any weights are read, and
`--help` without torch or the HTTP stack."""

from __future__ import annotations

import subprocess
import sys

import pytest

from phalanx.testing.cli_errors import assert_cli_error
from tests.hf_models import write_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_checkpoint(tmp_path_factory.mktemp("serve_cli") / "llama", "llama"))


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--num-kv-blocks", "0"], "--num-kv-blocks must be >= 1"),
    (["--kv-cache-memory", "-1"], "--kv-cache-memory must be a positive number"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--api-key", " "], "--api-key is empty"),
    (["--nproc", "4", "--plan", "dp=2,tp=2"], "dp beside tp) is not there yet"),
    (["--nproc", "2", "--plan", "tp=4"], "tp=4"),
    (["--nproc", "4", "--plan", "tp=4"], "invalid plan: tp=4 must divide n_kv_heads=2"),  # found by a benchmark
    (["--nproc", "2", "--plan", "cp=2"], "(pp, cp, sp, zero, or dp beside tp) is not there yet"),
    (["--nproc", "2", "--plan", "dp=2,ep=2", "--tpot-ms", "50"], "--ttft-ms/--tpot-ms with plan dp=2,ep=2 is not there yet"),
])
def test_bad_flags(model, capsys, flags, message):
    assert_cli_error(["serve", "--model", model, *flags], capsys, message)


def test_missing_model(capsys):
    assert_cli_error(["serve", "--model", "/nonexistent/model"], capsys, "/nonexistent/model")


def test_help_imports_no_torch():
    code = ("import sys\nfrom phalanx.cli import build_parser\nbuild_parser()\n"
            "heavy = [m for m in ('torch', 'uvicorn', 'starlette', 'prometheus_client') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_tool_call_parser_flag(model, capsys):
    """--tool-call-parser names a format (vLLM's names) into the job; another name is argparse's
    error, naming the choices, before anything is read."""
    from phalanx.cli import build_parser
    from phalanx.serve.job import prepare_job

    for given, expected in (([], None), (["--tool-call-parser", "llama3_json"], "llama3_json"),
                            (["--tool-call-parser", "hermes"], "hermes")):
        args = build_parser().parse_args(["serve", "--model", model, *given])
        assert prepare_job(args).tool_call_parser == expected
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--model", model, "--tool-call-parser", "mistral"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == ("phalanx serve: error: argument --tool-call-parser: invalid choice: 'mistral' "
                     "(choose from 'hermes', 'llama3_json')"), error


def _nan_copy(model: str, folder) -> str:
    """The checkpoint with one NaN in a layer norm's weight."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(model, folder / "nan"))
    weights = next(copy.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.layers.0.input_layernorm.weight"].view(-1)[0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    return str(copy)


def test_a_failed_load_never_prints_the_serving_line(model, tmp_path):
    """Issue 36: the "serving ... on http://" line came before non-finite weights or --device cuda
    without CUDA were found, so a supervisor waiting for it saw success. Now: one error line,
    exit 2, and no serving line (server.py prints it once the model is in)."""
    import torch

    cases = [(["--model", _nan_copy(model, tmp_path)], "holds non-finite values")]
    if not torch.cuda.is_available():
        cases.append((["--model", model, "--device", "cuda"], "torch sees no CUDA device"))
    for flags, message in cases:
        run = subprocess.run([sys.executable, "-m", "phalanx", "serve", *flags, "--port", "0"], capture_output=True,
                             text=True, timeout=180)
        errors = [line for line in run.stderr.splitlines() if line.strip()]
        assert run.returncode == 2, (flags, run.stdout, run.stderr)
        assert "serving" not in run.stdout and "Traceback" not in run.stderr, (run.stdout, run.stderr)
        assert len(errors) == 1 and errors[0].startswith("phalanx: error: ") and message in errors[0], errors


def test_the_key_from_the_environment(monkeypatch, capsys):
    """$PHALANX_API_KEY (issue 36: a key that no command line shows), UTF-8 as given; set but
    empty is one line, and two sources at once too."""
    from phalanx.cli import build_parser
    from phalanx.serve.job import KEY_ENV, prepare_job

    def key(*flags: str):
        return prepare_job(build_parser().parse_args(["serve", "--model", "m", *flags])).api_key

    monkeypatch.delenv(KEY_ENV, raising=False)
    assert key() is None
    monkeypatch.setenv(KEY_ENV, "clé-🔑")
    assert key() == "clé-🔑"
    assert key("--api-key", "given") == "given"  # the flag, when given, wins
    monkeypatch.setenv(KEY_ENV, " ")
    assert_cli_error(["serve", "--model", "m"], capsys, f"${KEY_ENV} is set but empty")
