"""The run directory across runs: `--resume auto|must`, the lock against a second run on one
--out, an unusable --out, a half-written metrics line, and settings that may or may not
change on resume. Each user mistake is one line, exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.cli import main
from phalanx.errors import UserError
from phalanx.train.launch import lock_run_dir
from phalanx.train.config import load_config
from phalanx.train.metrics import parse_lines

TINY = ["train", "--model", "tiny", "--global-batch", "4", "--seq-len", "16", "--no-progress", "--no-plot", "--sample-tokens", "0",
        "--eval-every", "0", "--device", "cpu", "--nproc", "1"]


def _run(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


def _fails(argv, capsys, *said):
    code, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("phalanx: error:"), err
    assert all(text in lines[0] for text in said), lines[0]


def _steps(run: Path) -> list[int]:
    return [row["step"] for row in parse_lines((run / "metrics.jsonl").read_text())[0]]


def test_resume_auto_starts_fresh_then_resumes(tmp_path, capsys):
    run = str(tmp_path / "r")
    assert _run([*TINY, "--steps", "2", "--resume", "auto", "--out", run], capsys)[0] == 0  # no checkpoint: fresh
    assert _run([*TINY, "--steps", "3", "--resume", "auto", "--out", run], capsys)[0] == 0  # from step 2
    assert _steps(tmp_path / "r") == [1, 2, 3]
    assert not (tmp_path / "r" / "loss.png").exists()  # --no-plot (test_launch.py sees the default draw it)
    _fails([*TINY, "--steps", "4", "--out", run], capsys, "already holds a run")  # no flag: refused as before


def test_partial_metrics_line_is_dropped_on_resume(tmp_path, capsys):
    run = tmp_path / "r"
    assert _run([*TINY, "--steps", "2", "--out", str(run)], capsys)[0] == 0
    with (run / "metrics.jsonl").open("a") as file:
        file.write('{"step": 3, "loss": 4.1, "l')  # a crash mid-write
    code, err = _run([*TINY, "--steps", "3", "--resume", "--out", str(run)], capsys)
    assert code == 0 and "dropped 1 unreadable line" in err, err
    assert _steps(run) == [1, 2, 3]
    assert all("ckpt_wait_s" in row for row in parse_lines((run / "metrics.jsonl").read_text())[0])


def test_settings_that_cannot_change_on_resume(tmp_path, capsys):
    run = str(tmp_path / "r")
    assert _run([*TINY, "--steps", "2", "--out", run], capsys)[0] == 0
    _fails([*TINY, "--steps", "3", "--seq-len", "32", "--resume", "--out", run], capsys, "seq_len=16", "seq_len=32")
    _fails([*TINY, "--steps", "3", "--model", "tiny-moe", "--resume", "--out", run], capsys, "model='tiny'", "model='tiny-moe'")
    (tmp_path / "notes.txt").write_text("hello phalanx. " * 200)
    _fails([*TINY, "--steps", "3", "--data", str(tmp_path / "notes.txt"), "--resume", "--out", run], capsys,
           "data=''", f"data={str(tmp_path / 'notes.txt')!r}")
    code, err = _run([*TINY, "--steps", "3", "--global-batch", "8", "--resume", "--out", run], capsys)
    assert code == 0 and "resuming with global_batch=8 (the checkpoint was written with 4)" in err, err


def test_second_run_on_a_locked_directory_is_refused(tmp_path, capsys):
    lock = lock_run_dir(tmp_path / "r")  # what a running launcher holds
    try:
        _fails([*TINY, "--steps", "2", "--out", str(tmp_path / "r")], capsys, "is in use by another phalanx train", "pid ")
    finally:
        lock.close()
    assert _run([*TINY, "--steps", "2", "--out", str(tmp_path / "r")], capsys)[0] == 0  # released: runs


def test_unusable_out(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    _fails([*TINY, "--out", str(tmp_path / "file")], capsys, "is a file, not a directory")
    _fails([*TINY, "--out", "/proc/phalanx-run"], capsys, "cannot write a run directory there")


def test_toml_resume_values(tmp_path):
    file = tmp_path / "run.toml"
    for text, expected in (("true", "must"), ("false", ""), ('"auto"', "auto"), ('"must"', "must")):
        file.write_text(f"resume = {text}\n")
        assert load_config(str(file), {}).resume == expected
    file.write_text('resume = "maybe"\n')
    with pytest.raises(UserError, match="resume='maybe' must be 'must' or 'auto'"):
        load_config(str(file), {})
