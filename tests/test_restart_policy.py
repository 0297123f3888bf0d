"""The one restart policy of `train`, `serve`, replica groups and `generate`
(phalanx/launch/restart_policy.py), on attempts that are plain functions: which failures restart, the
lines said, the restart's number and reason in the workers' environment, put back after."""

from __future__ import annotations

import os

from phalanx.launch.restart_policy import REASON_ENV, RESTART_ENV, Failure, max_restarts, run_attempts


def _attempts(results):
    """An attempt function giving `results` in turn, noting the environment each one saw."""
    seen = []

    def attempt(n):
        seen.append((n, os.environ.get(RESTART_ENV), os.environ.get(REASON_ENV)))
        return results[n]
    return attempt, seen


def test_a_failure_restarts_until_an_attempt_ends(capsys, monkeypatch):
    monkeypatch.delenv(RESTART_ENV, raising=False)
    attempt, seen = _attempts([(1, Failure("worker rank 1 exited with signal SIGKILL")), (0, None)])
    status = run_attempts(attempt, 3, restarting=lambda: "restarting from step 4")
    assert status == 0
    assert seen == [(0, None, None), (1, "1", "worker rank 1 exited with signal SIGKILL")]
    assert capsys.readouterr().err == ("phalanx: worker rank 1 exited with signal SIGKILL; restarting from step 4 "
                                       "(restart 1 of 3)\n")
    assert RESTART_ENV not in os.environ and REASON_ENV not in os.environ  # put back


def test_restarts_spent(capsys):
    attempt, seen = _attempts([(1, Failure("rank 0 of the server exited with status 1", "Traceback ...\n"))] * 2)
    assert run_attempts(attempt, 1, label="replica group 1: ", after=lambda: "last checkpoint: step 4") == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["Traceback ...", "phalanx: replica group 1: rank 0 of the server exited with status 1; restarting "
                   "(restart 1 of 1)", "Traceback ...", "phalanx: replica group 1: rank 0 of the server exited with "
                   "status 1; no restarts left (--max-restarts 1); last checkpoint: step 4"]


def test_user_error_and_stop_end_at_once_and_no_flag_says_it_plainly(capsys):
    for status in (2, 130, 143, 0):
        attempt, seen = _attempts([(status, None)])
        assert run_attempts(attempt, 3) == status and len(seen) == 1
    attempt, _ = _attempts([(1, Failure("worker rank 1 failed: RuntimeError: boom"))])
    assert run_attempts(attempt, 0, flag=None) == 1
    assert capsys.readouterr().err == "phalanx: worker rank 1 failed: RuntimeError: boom\n"
    attempt, _ = _attempts([(1, Failure("worker rank 1 failed: RuntimeError: boom"))])
    assert run_attempts(attempt, 0) == 1
    assert capsys.readouterr().err == "phalanx: worker rank 1 failed: RuntimeError: boom; not restarted (--max-restarts 0)\n"


def test_max_restarts_default():
    """train's config says -1 when not given, serve's None: both mean the default."""
    assert [max_restarts(c, n) for c, n in ((-1, 1), (None, 1), (-1, 2), (None, 4), (0, 4), (5, 1))] == [0, 0, 3, 3, 0, 5]
