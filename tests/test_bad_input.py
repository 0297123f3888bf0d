"""Each user mistake gives a one-line error, exit status 2, and no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from phalanx.cli import main
from phalanx.errors import UserError
from phalanx.testing.cli_errors import assert_cli_error

TINY = ["--model", "tiny", "--steps", "2", "--global-batch", "4", "--seq-len", "16", "--no-progress", "--no-plot", "--sample-tokens", "0"]


def _fails(argv, capsys, message):
    assert_cli_error(argv, capsys, message)


def test_missing_data_path(tmp_path, capsys):
    _fails(["train", *TINY, "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "r")], capsys, "does not exist")


def test_empty_data_file(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    _fails(["train", *TINY, "--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "r")], capsys, "is empty")


def test_empty_data_folder(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    _fails(["train", *TINY, "--data", str(tmp_path / "d"), "--out", str(tmp_path / "r")], capsys, "holds no text files")


def test_unknown_model(tmp_path, capsys):
    _fails(["train", "--model", "gpt-9", "--out", str(tmp_path / "r")], capsys, "unknown model 'gpt-9'; choose one of: tiny")


def test_unknown_config_key(tmp_path, capsys):
    (tmp_path / "run.toml").write_text('model = "tiny"\nlearning_rate = 0.1\n')
    _fails(["train", "--config", str(tmp_path / "run.toml")], capsys, "unknown key 'learning_rate'")


def test_config_wrong_type(tmp_path, capsys):
    (tmp_path / "run.toml").write_text('steps = "ten"\n')
    _fails(["train", "--config", str(tmp_path / "run.toml")], capsys, "steps = 'ten' should be of type int")


def test_plan_does_not_fit_processes(tmp_path, capsys):
    _fails(["train", *TINY, "--nproc", "2", "--plan", "dp=3", "--out", str(tmp_path / "r")], capsys,
           "dp=3 x tp=1 x pp=1 = 3, but 2 processes were started")


def test_global_batch_not_divisible(tmp_path, capsys):
    _fails(["train", *TINY, "--nproc", "2", "--global-batch", "3", "--out", str(tmp_path / "r")], capsys,
           "global_batch=3 must divide evenly into dp=2")


def test_resume_without_checkpoint(tmp_path, capsys):
    _fails(["train", *TINY, "--resume", "--out", str(tmp_path / "r")], capsys, "no checkpoint found")


def test_more_gpus_than_present(monkeypatch):
    import torch

    from phalanx.worker_group import check_nproc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match="asks for more GPUs than this machine has"):
        check_nproc(4, "auto")


def test_training_data_file_works(tmp_path):
    """The positive case beside the errors: a plain text file trains."""
    data = tmp_path / "text.txt"
    data.write_text("hello phalanx. " * 200)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *TINY, "--nproc", "1", "--data", str(data), "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 0
    assert (tmp_path / "r" / "metrics.jsonl").read_text().count("\n") == 2


def test_ctrl_c_stops_cleanly_and_keeps_checkpoint(tmp_path):
    """SIGINT to the whole process group (what Ctrl-C does) during a 2-process run: a short
    message, status 130, no traceback, and the last checkpoint left to resume from."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "phalanx", "train", "--model", "tiny", "--steps", "100000", "--global-batch", "4",
               "--seq-len", "16", "--ckpt-every", "2", "--nproc", "2", "--no-progress", "--no-plot", "--out", str(run)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not list(run.glob("checkpoints/step_*[0-9]")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(run.glob("checkpoints/step_*[0-9]")), "no checkpoint appeared"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Traceback" not in out
    assert "stopped by SIGINT; last checkpoint: step" in err
    assert "--resume" in err
