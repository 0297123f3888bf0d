"""A stuck rank ends the run within --collective-timeout, naming the step and the rank; under
the launcher, the group then restarts.

With a 5 s timeout, a rank that stalls before a step (`train`'s injected faults, sleeping 120 s)
makes the others' first collective of that step time out; they then meet in the barrier that
counts the ranks (at most the same 5 s), and rank 0 fails within 25 s (5 + 5 s plus start-up)
with an error that names the step and the missing rank, instead of hanging. No barrier runs in
steps that complete (step_sync.py). (The timeout is what the test waits out: 5 s is short, yet
far above the ranks' skew in a collective when none stalls.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from phalanx.cli import main
from phalanx.testing.fork_ranks import run_ranks
from phalanx.train.collective_watch import STALL_ENV
from phalanx.train.injected_faults import InjectedFaults
from phalanx.train.loop import train
from phalanx.train.metrics import parse_lines


def _train(cfg, faults):
    return train(cfg, Path(cfg.out), faults=faults).losses


def test_stalled_rank_is_named_within_the_collective_timeout(tiny_config):
    began = time.monotonic()
    with pytest.raises(RuntimeError) as error:  # rank 1 sleeps before step 1
        run_ranks(2, _train, tiny_config.replace(steps=1, collective_timeout=5.0), InjectedFaults(stall=(1, 1, 120.0)))
    assert time.monotonic() - began < 25
    assert ("CollectiveTimeout: rank 0: a collective of step 1 waited past 5 s (--collective-timeout); the ranks "
            "then counted within 5 s: [Rank 0]: Ranks 1 failed to pass monitoredBarrier") in str(error.value), error.value


def test_stalled_rank_under_the_launcher_is_restarted(tmp_path, capsys, monkeypatch):
    """dp=2 under the built-in launcher: rank 1 stalls 12 s before step 3 (first attempt only),
    rank 0's gradient all-reduce gives up after 10 s, the barrier that counts the ranks names
    rank 1, and the group restarts from the step-2 checkpoint and finishes, with one row per
    step and a restart row that says why."""
    monkeypatch.setenv(STALL_ENV, "1:3:12")
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "tiny", "--global-batch", "4", "--seq-len", "16", "--no-progress", "--no-plot", "--sample-tokens", "0",
              "--eval-every", "0", "--device", "cpu", "--ckpt-every", "2", "--sync-checkpoint", "--steps", "4",
              "--nproc", "2", "--collective-timeout", "10", "--out", str(run)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 0, err
    assert "Traceback" not in err, err  # a stuck rank is one line, not a crash
    assert ("phalanx: worker rank 0 failed: CollectiveTimeout: rank 0: a collective of step 3 waited past 10 s "
            "(--collective-timeout); the ranks then counted within 10 s: [Rank 0]: Ranks 1 failed to pass monitoredBarrier"
            ) in err and "restarting from step 2 (restart 1 of 3)" in err, err
    rows, _ = parse_lines((run / "metrics.jsonl").read_text())
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3, 4]
    restart = [row for row in rows if row.get("event") == "restart"]
    assert len(restart) == 1 and restart[0]["step"] == 2 and "CollectiveTimeout" in restart[0]["reason"], restart
