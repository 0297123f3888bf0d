"""A dead worker costs a restart, never the run; SIGTERM and Ctrl-C stop with a checkpoint.

A restarted run resumes from a checkpoint and replays the steps after it. Batches are a
function of (seed, step) and the learning rate of the step, and the restarted workers run the
same layout with the same thread count on the same machine, so every replayed and later step
does the same arithmetic in the same order as the uninterrupted run: losses and weights are
compared bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from phalanx.cli import main
from phalanx.train.bad_steps import NAN_STEPS_ENV
from phalanx.checkpoint.store import latest_checkpoint
from phalanx.train.metrics import parse_lines, read_metrics
from phalanx.train.restarts import FAULT_ENV, USER_ERROR_FILE

TINY = ["train", "--model", "tiny", "--global-batch", "4", "--seq-len", "16", "--no-progress", "--no-plot", "--sample-tokens", "0",
        "--eval-every", "0", "--device", "cpu", "--ckpt-every", "2"]


def _run(argv, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()


def _rows(run: Path) -> list[dict]:
    return parse_lines((run / "metrics.jsonl").read_text())[0]


def _final_weights(run: Path, scratch: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(str(latest_checkpoint(run)[1]), str(scratch))
    return torch.load(scratch, weights_only=False)["model"]


def _assert_same_run(run: Path, reference: Path, tmp_path: Path) -> None:
    """One row per step, losses and final weights bit-equal to the uninterrupted run."""
    steps = [row["loss"] for row in read_metrics(run / "metrics.jsonl")]
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == list(range(1, len(steps) + 1))
    assert steps == [row["loss"] for row in read_metrics(reference / "metrics.jsonl")]
    got, want = _final_weights(run, tmp_path / "got.pt"), _final_weights(reference, tmp_path / "want.pt")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    rows = parse_lines(path.read_text())[0] if path.exists() else []
    return rows[-1]["step"] if rows and "loss" in rows[-1] else 0


def _children(pid: int) -> list[int]:
    """The processes `pid` started (its workers), from /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def test_worker_sigkilled_from_outside_then_sigterm(tmp_path, capsys):
    """dp=2 under the real launcher (a separate process): one worker is SIGKILLed from
    outside after step 3; the group restarts from the step-2 checkpoint. Later SIGTERM to the
    launcher: every rank finishes its step, saves, the resume command is printed, exit 0. The
    resumed run then finishes equal to an uninterrupted one."""
    run, reference = tmp_path / "run", tmp_path / "ref"
    # --no-adapt: the comparison is bit-equal, and adapted shares (decided from measured
    # timings, from step 8 on) would change the order the ranks' gradients are summed in.
    args = [*TINY, "--steps", "12", "--nproc", "2", "--no-adapt"]
    launcher = subprocess.Popen([sys.executable, "-m", "phalanx", *args, "--out", str(run)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Checkpoints are written in the background: the kill waits for step 2's to complete.
        _wait_for(lambda: _last_step(run) >= 3 and latest_checkpoint(run) is not None, "step 3 and a checkpoint")
        os.kill(_children(launcher.pid)[-1], signal.SIGKILL)
        _wait_for(lambda: any(r.get("event") == "restart" for r in _rows(run)) and _last_step(run) >= 5, "the restart")
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err
    lines = err.strip().splitlines()
    threads = [line for line in lines if " intra-op thread" in line]  # phalanx/threads.py: one per worker start
    lines = [line for line in lines if line not in threads]
    assert len(threads) == 2 and len(lines) == 3 and all(line.startswith("phalanx: ") for line in lines), err  # no agent log lines
    assert "exited with signal SIGKILL; restarting from step " in lines[1], err
    stopped_at = latest_checkpoint(run)[0]
    assert lines[2] == (f"phalanx: stopped by SIGTERM; last checkpoint: step {stopped_at} in "
                        f"{run / 'checkpoints' / f'step_{stopped_at:06d}'}; continue with: phalanx train --out {run} --resume auto")
    restart = [r for r in _rows(run) if r.get("event") == "restart"]
    assert len(restart) == 1 and restart[0]["restart"] == 1 and "SIGKILL" in restart[0]["reason"], restart
    assert restart[0]["step"] >= 2 and restart[0]["step"] % 2 == 0 and stopped_at >= 5 and _last_step(run) == stopped_at < 12

    assert _run([*args, "--resume", "auto", "--out", str(run)], capsys)[0] == 0
    assert _run([*args, "--out", str(reference)], capsys)[0] == 0
    _assert_same_run(run, reference, tmp_path)


def test_worker_killed_on_four_processes_zero3_pipeline(tmp_path, capsys, monkeypatch):
    """dp=2,pp=2 with ZeRO-3 on 4 processes: rank 3 SIGKILLs itself after step 3 (the test
    hook), the run restarts from step 2, replays step 3 and ends equal to an uninterrupted run.
    Saves are synchronous here: a background step-2 save can still be in flight when rank 3
    dies after step 3 (seen once steps got faster), and the restart then rightly starts over."""
    run, reference = tmp_path / "run", tmp_path / "ref"
    args = [*TINY, "--steps", "4", "--nproc", "4", "--plan", "dp=2,pp=2,zero=3,microbatches=2", "--sync-checkpoint"]
    assert _run([*args, "--out", str(reference)], capsys)[0] == 0
    monkeypatch.setenv(FAULT_ENV, "3:3:SIGKILL")
    code, err = _run([*args, "--out", str(run)], capsys)
    assert code == 0 and "phalanx: worker rank 3 exited with signal SIGKILL; restarting from step 2 (restart 1 of 3)" in err, err
    assert [r["step"] for r in _rows(run)] == [1, 2, 2, 3, 4]  # the replayed step 3 replaced its first row
    assert _rows(run)[2] == {"event": "restart", "step": 2, "restart": 1, "reason": "worker rank 3 exited with signal SIGKILL"}
    _assert_same_run(run, reference, tmp_path)


def test_user_error_in_a_worker_is_not_retried(tmp_path, capfd, monkeypatch):
    """NaN at steps 1-2 with --max-bad-steps 1 stops the run with a user error inside the
    workers (exit 2): one error line (printed by rank 0: capfd sees the workers' stderr), no restart."""
    monkeypatch.setenv(NAN_STEPS_ENV, "1,2")
    code, err = _run([*TINY, "--steps", "4", "--nproc", "2", "--max-bad-steps", "1", "--out", str(tmp_path / "r")], capfd)
    assert code == 2 and sum(line.startswith("phalanx: error: stopped at step 2") for line in err) == 1, err
    assert not any("restart" in line for line in err) and not any(r.get("event") == "restart" for r in _rows(tmp_path / "r"))


def test_ctrl_c_on_one_process_saves_and_exits_130(tmp_path, capsys, monkeypatch):
    """One process, no agent: SIGINT after step 3 (ckpt every 2) saves step 3 and says how to go on."""
    monkeypatch.setenv(FAULT_ENV, "0:3:SIGINT")
    code, err = _run([*TINY, "--steps", "6", "--nproc", "1", "--out", str(tmp_path / "r")], capsys)
    assert code == 130 and err[-1].startswith("phalanx: stopped by SIGINT; last checkpoint: step 3 in "), err
    assert err[-1].endswith(f"continue with: phalanx train --out {tmp_path / 'r'} --resume auto")
    assert [r["step"] for r in _rows(tmp_path / "r")] == [1, 2, 3]


def test_torchrun_restart_does_not_retry_a_user_error(tmp_path, capsys, monkeypatch):
    """Under torchrun, rank 0 leaves its user error in the run directory; a restarted worker
    (TORCHELASTIC_RESTART_COUNT > 0) repeats it in one line and exits 2 before starting; a
    first attempt removes it."""
    run = tmp_path / "r"
    run.mkdir()
    (run / USER_ERROR_FILE).write_text("bad plan\n")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    code, err = _run([*TINY, "--out", str(run)], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("phalanx: error: bad plan (an earlier attempt"), err
    from phalanx.train.restarts import earlier_user_error, resume_mode

    assert resume_mode("") == "auto"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert earlier_user_error(run) is None and not (run / USER_ERROR_FILE).exists() and resume_mode("") == ""


def test_max_restarts_setting(tmp_path, capsys):
    """The default follows the process count; TOML key max_restarts; a negative count is refused."""
    from phalanx.train.config import load_config
    from phalanx.launch.restart_policy import max_restarts

    assert (max_restarts(-1, 1), max_restarts(-1, 2), max_restarts(0, 4), max_restarts(5, 1)) == (0, 3, 0, 5)
    (tmp_path / "run.toml").write_text("max_restarts = 5\n")
    assert load_config(str(tmp_path / "run.toml"), {}).max_restarts == 5
    from phalanx.testing.cli_errors import assert_cli_error

    assert_cli_error([*TINY, "--max-restarts", "-2", "--out", str(tmp_path / "r")], capsys, "max_restarts=-2 must not be negative")


def test_torchrun_restart_keeps_process_group_keys_apart(monkeypatch):
    """torchrun's agent store outlives its workers: a restarted attempt must not read the
    failed attempt's process-group keys (a dead rank's gloo address), so it writes under a
    prefix of its own; a first attempt uses the store as torch does."""
    import torch.distributed as dist

    from phalanx.worker_group import _attempt_store
    from phalanx.ports import free_port

    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert _attempt_store(2) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    agent_store.set("default_pg/rank_0", "dead address")
    restarted = _attempt_store(2)
    assert not restarted.check(["default_pg/rank_0"])
    restarted.set("default_pg/rank_0", "new address")
    assert agent_store.get("phalanx/attempt_1/default_pg/rank_0") == b"new address"
    assert agent_store.get("default_pg/rank_0") == b"dead address"


def test_a_resumed_run_says_so(tmp_path, capsys):
    """`train --resume` names the checkpoint it goes on from (not "random initialization") and
    its summary counts the steps this run took (not the step it reached)."""
    run = tmp_path / "run"
    assert _run([*TINY, "--nproc", "1", "--steps", "2", "--out", str(run)], capsys)[0] == 0
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, "--nproc", "1", "--steps", "3", "--resume", "--out", str(run)])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    start = [line for line in err.splitlines() if line.startswith("phalanx: training ")]
    assert len(start) == 1 and "resuming from its checkpoint of step 2" in start[0], err
    assert "random initialization" not in start[0]
    assert "done: step 3, 1 step in this run (from step 2)" in out, out
