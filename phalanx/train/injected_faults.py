"""Faults a test injects into a training run, given to `train()` as an argument.

The loop reads no environment variable: `InjectedFaults` is plain data handed to it. Tests that
call `train()` in their own processes build one directly; tests that start workers through the
launcher (a `phalanx train --nproc N` under pytest) set the documented variables, and the
worker's entry (`launch.worker_main`) reads them once, with `from_env()`:

- `restarts.FAULT_ENV`  `RANK:STEP:SIGNAL`: rank RANK sends itself SIGNAL once STEP steps are done;
- `collective_watch.STALL_ENV`  `RANK:STEP:SECONDS`: rank RANK sleeps before step STEP (1-based);
- `bad_steps.NAN_STEPS_ENV`  `S1,S2,...`: those steps' (1-based) loss is made NaN after the backward;
- `REJOIN_STALL_ENV`  `RANK:SECONDS`: rank RANK (across replica groups), restarted, sleeps
  before its group's torchft manager starts (and heartbeats);
- `IN_STEP_FAULT_ENV`  `RANK:STEP:SIGNAL`: rank RANK (across replica groups) sends itself SIGNAL
  in step STEP (1-based), after its backward, before the replica groups' all-reduce;
- `IN_STEP_STALL_ENV`  `RANK:STEP:SECONDS`: rank RANK (across replica groups) sleeps there;
- `checkpoint.store.DIE_IN_SAVE_ENV`  `STEP`: rank 0 SIGKILLs itself in the middle of saving that
  step's checkpoint (after the shards, before the manifest), on every attempt;
- `fault_tolerance.DIGEST_ENV`  set: rank 0 of each replica group appends a digest of its weights
  and optimizer state after every step (not a fault: a probe the replica-group tests read).

Kills and stalls happen on a first attempt only: a restarted worker must not meet them again;
a rejoin stall only on a restart.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from phalanx.checkpoint.store import DIE_IN_SAVE_ENV
from phalanx.parallel.fault_tolerance import DIGEST_ENV
from phalanx.train.bad_steps import NAN_STEPS_ENV
from phalanx.train.collective_watch import STALL_ENV
from phalanx.train.restarts import FAULT_ENV, restart_count

REJOIN_STALL_ENV = "PHALANX_TEST_REJOIN_STALL"
"""A replica group's restart forks its workers from a forkserver that has everything imported,
and may be back at the quorum before the lighthouse stops counting the failed workers (its
heartbeat timeout): then no step runs without it. A test that needs the other groups to step
alone meanwhile delays the restarted worker with this."""

IN_STEP_FAULT_ENV = "PHALANX_TEST_FAULT_IN_STEP"
"""A worker killed at a step boundary dies before the other groups' all-reduce has it; one
killed in the middle of a step breaks that all-reduce, which the surviving groups then run
again without it (fault_tolerance.ReplicaGroupSync.reduce). A test of that path sets this."""


IN_STEP_STALL_ENV = "PHALANX_TEST_STALL_IN_STEP"
"""A group whose all-reduce a failed group broke, and that meets the failed group restarted at
its new quorum, hands it its state in the middle of the step: the restarted group sits that
step out (fault_tolerance.ReplicaGroupSync.sitting_out). A test holds a group before its
all-reduce with this until the other group is back, to take that path."""


@dataclass(frozen=True, kw_only=True)
class InjectedFaults:
    kill: tuple[int, int, str] | None = None
    """(rank, steps done, signal name): that rank signals itself at that step boundary (after
    the step's checkpoint, if any)."""
    stall: tuple[int, int, float] | None = None
    """(rank, step, seconds): that rank sleeps before that step (1-based), like a rank stuck in
    I/O or a hung kernel."""
    nan_steps: frozenset[int] = frozenset()
    """Steps (1-based) whose loss is made NaN after the backward pass."""
    rejoin_stall: tuple[int, float] | None = None
    """(rank, seconds): that rank, restarted, sleeps before its replica group's manager starts."""
    kill_in_step: tuple[int, int, str] | None = None
    """(rank, step, signal name): that rank signals itself in that step (1-based), after its
    backward, before the replica groups' all-reduce."""
    stall_in_step: tuple[int, int, float] | None = None
    """(rank, step, seconds): that rank sleeps there."""
    die_in_save: int | None = None
    """The step whose checkpoint save rank 0 dies in (checkpoint/store.finish_save)."""
    state_digests: bool = False
    """Each replica group's rank 0 records a digest of its state after every step
    (`fault_tolerance.state_digest`)."""

    @classmethod
    def from_env(cls) -> "InjectedFaults":
        """The faults the test variables name; a restarted worker gets no kill and no stall but
        the rejoin stall."""
        kill = stall = in_step = in_step_stall = None
        if (text := os.environ.get(FAULT_ENV, "")) and not restart_count():
            who, when, name = text.split(":")
            kill = (int(who), int(when), name)
        if (text := os.environ.get(IN_STEP_FAULT_ENV, "")) and not restart_count():
            who, when, name = text.split(":")
            in_step = (int(who), int(when), name)
        if (text := os.environ.get(IN_STEP_STALL_ENV, "")) and not restart_count():
            who, when, seconds = text.split(":")
            in_step_stall = (int(who), int(when), float(seconds))
        if (text := os.environ.get(STALL_ENV, "")) and not restart_count():
            who, when, seconds = text.split(":")
            stall = (int(who), int(when), float(seconds))
        rejoin = None
        if (text := os.environ.get(REJOIN_STALL_ENV, "")) and restart_count():
            who, seconds = text.split(":")
            rejoin = (int(who), float(seconds))
        nan = frozenset(int(part) for part in os.environ.get(NAN_STEPS_ENV, "").split(",") if part.strip())
        return cls(kill=kill, stall=stall, nan_steps=nan, rejoin_stall=rejoin, kill_in_step=in_step,
                   stall_in_step=in_step_stall, state_digests=bool(os.environ.get(DIGEST_ENV)),
                   die_in_save=int(text) if (text := os.environ.get(DIE_IN_SAVE_ENV, "")) else None)

    def before_rejoin(self, rank: int) -> None:
        """Before a replica group's torchft manager starts (`rank`: across replica groups): while
        none heartbeats, the lighthouse drops the group and the others step without it."""
        if self.rejoin_stall is not None and self.rejoin_stall[0] == rank:
            time.sleep(self.rejoin_stall[1])

    def before_step(self, rank: int, steps_done: int) -> None:
        """At each step boundary, with the steps done so far (`rank`: across replica groups)."""
        if self.kill is not None and self.kill[:2] == (rank, steps_done):
            os.kill(os.getpid(), signal.Signals[self.kill[2]])
        if self.stall is not None and self.stall[:2] == (rank, steps_done + 1):
            time.sleep(self.stall[2])

    def after_backward(self, rank: int, step: int) -> None:
        """In step `step` (1-based), after the backward (`rank`: across replica groups)."""
        if self.kill_in_step is not None and self.kill_in_step[:2] == (rank, step):
            os.kill(os.getpid(), signal.Signals[self.kill_in_step[2]])
        if self.stall_in_step is not None and self.stall_in_step[:2] == (rank, step):
            time.sleep(self.stall_in_step[2])
