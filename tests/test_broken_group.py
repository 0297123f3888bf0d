"""A replica group with a dead worker ends its other workers' torchft waits at once
(phalanx/parallel/broken_group.py), and the metrics' event rows name a group that restarted
without missing a step (phalanx/parallel/fault_tolerance.py's `membership_events`).

The watch is tested on real processes (a child that is killed), with its exit replaced by a
note, so the test process lives on."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from phalanx.launch.restart_policy import Failure
from phalanx.launch.worker_launch import describe
from phalanx.parallel import broken_group
from phalanx.parallel.broken_group import BrokenGroupWatch, alive
from phalanx.parallel.fault_tolerance import StepReduction, membership_events


def _sleeper():
    time.sleep(60)


def _sibling():
    process = multiprocessing.get_context("fork").Process(target=_sleeper, daemon=True)
    process.start()
    return process


def _watch(siblings, noted=None):
    exited = threading.Event()
    return BrokenGroupWatch(siblings, exit_now=lambda status: exited.set(),
                            on_broken=None if noted is None else lambda: noted.append(exited.is_set())), exited


def test_a_dead_sibling_ends_a_torchft_wait_at_once():
    """And `on_broken` (a rank 0's manager stops heartbeating) comes first, once."""
    sibling = _sibling()
    noted = []
    watch, exited = _watch([sibling.pid], noted)
    try:
        with watch.waiting():
            time.sleep(3 * broken_group.POLL_S)
            assert not exited.is_set() and not noted  # a live sibling: the wait goes on
            os.kill(sibling.pid, signal.SIGKILL)
            # Measured against the watch's own poll, not a speed: a few polls at most.
            assert exited.wait(30), "the watch did not end the wait"
        assert noted == [False]  # called before the exit, not after
    finally:
        watch.stop()
        sibling.kill()


STAY_S = 2.0


def _watch_then_sigterm(conn, signalled: bool) -> None:
    """In a forked child's main thread, as in a worker: SIGTERM only noted (stop_signal.py), a
    watch over a sibling that dies inside a torchft wait; sends how long after the sibling's
    death the watch's exit came."""
    from phalanx.train.stop_signal import StopSignals

    broken_group.REPORT_S = STAY_S  # this child's: long against any delay of a loaded machine
    with StopSignals():
        sibling = _sibling()
        exited = threading.Event()
        watch = BrokenGroupWatch([sibling.pid], exit_now=lambda status: exited.set())
        watch.enter()
        time.sleep(2 * broken_group.POLL_S)
        killed = time.monotonic()
        os.kill(sibling.pid, signal.SIGKILL)
        time.sleep(0.02)
        if signalled:  # the agent's pass saw the dead sibling and stops the rest
            os.kill(os.getpid(), signal.SIGTERM)
        exited.wait(30)
        conn.send(time.monotonic() - killed)
        watch.stop()


def test_the_agents_sigterm_ends_the_stay_after_a_dead_sibling():
    """A worker that found its sibling dead stays up to REPORT_S (so that the agent's pass sees
    the dead one first and names it), but leaves at once when the agent's SIGTERM comes: the
    agent sends it only after its pass saw the failure, and the group's restart waits for it.
    The handler runs in the main thread; the main thread here is blocked (as in torchft's
    wait) and the watch learns of the signal through set_wakeup_fd."""
    context = multiprocessing.get_context("fork")
    took = {}
    for signalled in (False, True):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_watch_then_sigterm, args=(send, signalled))
        child.start()
        assert receive.poll(60)
        took[signalled] = receive.recv()
        child.join(10)
    # Without the signal the stay is REPORT_S (plus the watch's poll); with it, the poll alone.
    assert took[False] >= STAY_S, took
    assert took[True] < STAY_S, took


def test_no_exit_outside_a_torchft_wait_or_after_stop():
    """A sibling that exits while this worker is not in a torchft wait (a gloo collective fails
    by itself; the end of the run is no failure), or after the watch stopped, ends nothing."""
    sibling = _sibling()
    watch, exited = _watch([sibling.pid])
    os.kill(sibling.pid, signal.SIGKILL)
    sibling.join(10)
    assert not alive(sibling.pid)
    time.sleep(5 * broken_group.POLL_S)
    assert not exited.is_set()
    watch.stop()
    with watch.waiting():
        time.sleep(5 * broken_group.POLL_S)
    assert not exited.is_set()


def test_a_zombie_is_not_alive():
    """A child killed but not yet reaped by its parent is dead to the watch."""
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    try:
        assert alive(pid)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(pid):  # not reaped: /proc shows it as a zombie
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        os.waitpid(pid, 0)


def _reduction(groups, healed=()):
    return StepReduction(loss_sum=torch.zeros(()), groups=list(groups), healed=list(healed))


def test_membership_events():
    assert membership_events(5, None, _reduction([0, 1])) == []
    assert membership_events(5, [0, 1], _reduction([0, 1])) == []
    assert membership_events(5, [0, 1], _reduction([0])) == [{"event": "group_lost", "step": 5, "group": 1}]
    # Back after missing steps: it heals at its first step again.
    assert membership_events(8, [0], _reduction([0, 1], healed=[1])) == [{"event": "group_rejoined", "step": 8, "group": 1}]
    # Restarted between two steps without missing one: lost and rejoined at the same step.
    assert membership_events(9, [0, 1], _reduction([0, 1], healed=[1])) == [
        {"event": "group_lost", "step": 9, "group": 1}, {"event": "group_rejoined", "step": 9, "group": 1}]


def _fails_with_a_thread_left(status):
    threading.Thread(target=time.sleep, args=(600,), name="blocked-on-a-dead-rank").start()  # not a daemon
    if status is None:
        raise RuntimeError("a collective with a dead rank")
    return status


def test_a_failed_worker_leaves_without_waiting_for_its_threads(tmp_path, monkeypatch):
    """phalanx/launch/worker_launch.py's `elastic_entry`: a worker that failed (status 1 or an exception)
    exits though a thread of it is still blocked (a background save's collective on a dead
    rank), instead of waiting in the interpreter's shutdown for the agent's kill 30 s later."""
    from phalanx.launch.worker_launch import elastic_entry

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))  # where `record` writes
    context = multiprocessing.get_context("fork")
    for status in (1, None):
        worker = context.Process(target=elastic_entry, args=(_fails_with_a_thread_left, (status,), None))
        worker.start()
        worker.join(20)  # without the fix it never ends: the thread sleeps 600 s
        alive_after = worker.is_alive()
        worker.kill()
        assert not alive_after and worker.exitcode == 1, (status, worker.exitcode)


def test_the_dead_worker_is_named_not_the_sibling_that_left():
    """The elastic agent's failure times are whole seconds: a worker that left because its
    sibling was killed (status 1, no recorded error), seen in the same pass, ties with it, and
    torch's own choice (the lowest rank) named the one that left. The launcher's line names the
    killed one, also when the agent's clock passed a second between the two; and the one that
    failed first when an earlier pass saw it."""
    left = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="/nonexistent")
    killed = ProcessFailure(local_rank=1, pid=2, exitcode=-signal.SIGKILL, error_file="/nonexistent")
    killed.timestamp = left.timestamp
    error = ChildFailedError("train", {0: left, 1: killed})
    assert error.get_first_failure()[0] == 0  # what describe() said before
    assert describe(error) == (1, Failure("worker rank 1 exited with signal SIGKILL"))
    left.timestamp = killed.timestamp - 1  # the agent's clock passed a second between the two
    assert describe(error) == (1, Failure("worker rank 1 exited with signal SIGKILL"))
    left.timestamp = killed.timestamp - 2  # an earlier pass: it did fail first
    assert describe(error) == (1, Failure("worker rank 0 exited with status 1"))
