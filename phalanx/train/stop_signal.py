"""SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) stop a run at a step boundary.

A worker catches both signals from its first moment and only notes them; each step's one
small collective carries whether any rank has one (`step_sync.StepSync`: two counts beside the
step's loss, no collective of their own), so every rank stops after the same step (the one
whose collective first carried the signal), saves a checkpoint, and the run exits with
`STOP_STATUS` (the launcher turns 143 into 0, and prints the command to resume).

Under the built-in launcher, the elastic agent receives the signal, passes it to every worker
and waits `GRACE_S` before killing them: that is how long the current step and the save may take.
"""

from __future__ import annotations

import signal
import threading
import time

from phalanx.launch.restart_policy import STOP_STATUS  # noqa: F401 (exit status of a worker stopped by each signal)

GRACE_S = 120
"""Seconds the built-in launcher's agent waits for stopped workers to finish a step and save."""


class StopSignals:
    """Notes SIGTERM and SIGINT while entered (only in the main thread, where Python runs
    signal handlers), and puts the previous handlers back on exit."""

    def __init__(self) -> None:
        self.received = 0
        self._saved: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_STATUS:
                self._saved[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _note(self, signum: int, frame) -> None:
        self.received = self.received or signum  # the first one decides the exit status

    def wait(self, seconds: float) -> int:
        """Up to `seconds` for a signal; the one received, or 0."""
        deadline = time.monotonic() + seconds
        while not self.received and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.received


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
