"""A replica group whose worker died ends at once, instead of 30 s later (`BrokenGroupWatch`).

When one worker of a replica group dies (SIGKILL, the OOM killer), the group's other workers
are often waiting in one of torchft's calls for it: the group's quorum or commit, which torchft's
manager (a server in the group's rank 0) answers only once every rank of the group has asked,
within the manager's timeout (`--collective-timeout`, 600 s by default). The elastic agent
notices the death within 0.1 s and sends the others SIGTERM, but a worker only notes SIGTERM
(it stops after a step, with a checkpoint: phalanx/train/stop_signal.py), so it waits on, and the
agent kills it after its fixed 30 s (torch 2.13: `LocalElasticAgent._stop_workers` calls
`_shutdown()` with its default timeout, not the launch's `shutdown_timeout`). Meanwhile the
group's manager keeps heartbeating to the lighthouse, whose quorum needs more than half of the
heartbeating groups: with two groups the healthy one waited for those 30 s too (measured: the
surviving group's quorum took 32.07 s, the dead group's launcher saw the failure 30.5 s after
the kill; issue 41's 36.9 s rejoin).

So each worker of a group of several processes learns its siblings' process ids when it joins
(one all-gather in the group) and a thread looks every `POLL_S`: while this worker is inside a
step's torchft span (`enter` .. `leave`: from the step's quorum to its commit, when every process
of the group must take part; `waiting()` for a shorter one) for longer than `POLL_S` and a
sibling has exited, the group cannot finish the step, and the worker exits at once (`os._exit`:
the wait may be in torchft's own threads and Rust code, which no exception reaches), which also
ends its manager's heartbeats. The span is the whole step's, forward and backward included, not
only torchft's waits: a worker whose sibling died in its forward would otherwise run on to the
group's next collective (up to a step's compute, measured 0.6-0.8 s from the kill to the group's
restart on the loaded 2-core machine), holding back its restart and, heartbeating meanwhile,
the lighthouse's next quorum. Outside the span nothing is done: a sibling that exits at the end
of the run (or after a stop signal, after the last step) is not a failure. The siblings are
processes of this machine (replica groups are one launcher's, on one node).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager

from phalanx.restart_timeline import mark

POLL_S = 0.05
"""How often the watch looks (one read of /proc per sibling), and how long this worker must have
been in its step's span before a dead sibling counts. 0.1 s before: half of it comes off a
failure's path twice, to the group's restart and to the end of its heartbeats."""

REPORT_S = 0.2
"""How long at most this worker stays after it found a sibling dead (its manager's heartbeats
already stopped, `on_broken`): twice the elastic agent's monitor interval (0.1 s,
worker_group.start_elastic), so that one of the agent's passes sees the dead sibling while this
worker still lives, and the launcher's line names the sibling. torch reports one failure per
pass, the first process it finds: when both had gone, the lowest rank, and the line said
`worker rank 0 exited with status 1` for a killed rank 1 (2 of 3 kills in a benchmark run,
when the worker left 0.05 s after its sibling). The agent's SIGTERM ends the stay early: the
agent sends it only once a pass has seen a failure (the dead sibling: this worker still
lives), and stops the workers left before it reports, so every moment of the stay after it
held the group's restart back (0.2-0.4 s from the dead sibling found to the launcher's
restart, measured, `goodput.py --timeline`)."""

BROKEN_STATUS = 1
"""The exit status of a worker whose group broke (the agent reports the sibling that died first)."""


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel (a zombie then counts as alive)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class BrokenGroupWatch:
    """This worker's watch over its group's other processes (see the module docstring).
    `enter()` .. `leave()` (or `waiting()`) marks the span in which every sibling must live;
    `stop()` ends the watch; `on_broken()` is called as soon as a sibling is found dead, before
    the exit (a replica group's rank 0 stops its torchft manager's heartbeats there)."""

    def __init__(self, siblings: list[int], *, exit_now=os._exit, on_broken=None):
        self.siblings, self.exit_now, self.on_broken = siblings, exit_now, on_broken
        self.since: float | None = None
        self.done = threading.Event()
        self.signals = SignalPipe() if siblings else None
        self.thread = threading.Thread(target=self._run, name="phalanx-broken-group", daemon=True)
        if siblings:
            self.thread.start()

    def enter(self) -> None:
        """From now on every sibling must be alive (until `leave`)."""
        self.since = time.monotonic()

    def leave(self) -> None:
        self.since = None

    @contextmanager
    def waiting(self):
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def stop(self) -> None:
        self.done.set()
        if self.signals is not None:
            self.signals.close()

    def _run(self) -> None:
        while not self.done.wait(POLL_S):
            since = self.since
            if since is None or time.monotonic() - since < POLL_S:
                continue
            dead = [pid for pid in self.siblings if not alive(pid)]
            if dead and self.since is not None and not self.done.is_set():
                mark("sibling_dead")
                if self.on_broken is not None:
                    try:
                        self.on_broken()
                    except Exception:  # noqa: BLE001 (leaving anyway: the group is broken)
                        pass
                self.signals.wait(REPORT_S)  # the agent's SIGTERM, when it comes first
                # Quietly: the launcher says in one line which worker died and that the group restarts.
                sys.stderr.flush()
                self.exit_now(BROKEN_STATUS)
                return


class SignalPipe:
    """Says in any thread that this process received a signal that has a Python handler (the
    worker's SIGTERM, which `stop_signal.StopSignals` notes), as it arrives: Python runs a
    handler only in the main thread, and only once that thread is back from the call it is in
    (here a wait in torchft's own code), but writes the signal's number at once to the file
    descriptor `signal.set_wakeup_fd` names. Only where made in the main thread, else a plain
    sleep; `close` puts back the descriptor that was there."""

    def __init__(self) -> None:
        self.read = self.saved = None
        if threading.current_thread() is not threading.main_thread():
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self.saved = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter
            os.close(read)
            os.close(write)
            return
        self.read, self.write = read, write

    def wait(self, seconds: float) -> bool:
        """Up to `seconds` for a signal from now on or since this pipe was made; whether one came."""
        if self.read is None:
            time.sleep(seconds)
            return False
        try:
            return bool(select.select([self.read], [], [], seconds)[0])
        except OSError:  # closed meanwhile (`stop` at the run's end): the worker leaves anyway
            return False

    def close(self) -> None:
        if self.read is None or threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(self.saved, warn_on_full_buffer=False)
        os.close(self.read)
        os.close(self.write)
        self.read = None
