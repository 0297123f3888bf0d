"""Serving over several ranks (`--nproc N --plan tp=N`): rank 0 runs HTTP and the scheduler,
and before every step sends the other ranks its plain-data description
(`serve/input_batch.StepMessage`: the changes to the block tables every rank keeps, then per
forward the token ids, positions and which logits are read), so every rank runs the same
forward, collectives included, on its own slice of the weights and its own kv heads.
Sampling happens on rank 0 only (every rank holds the gathered logits anyway).
Under attention data parallelism (`--plan dp=N,ep=N`) the message holds each dp rank's own
forwards instead, and the logits come back to rank 0 (`dp_engine.py`).

Staying up while idle, and noticing a dead rank:
- The process group's timeout (`--collective-timeout`) bounds every collective, the wait for
  the next message included. So while there is no work rank 0 sends a heartbeat every
  `heartbeat_s` (a quarter of the timeout, at most a second): the other ranks' wait never
  reaches the timeout however long the server idles, and a rank that died is noticed at the
  next heartbeat, within a second, not at the next request.
- A collective with a dead rank fails at once on gloo ("Connection closed by peer"), or at the
  timeout where the rank hangs instead. On rank 0 either ends its step or heartbeat with an
  error (serve/engine_loop.py): the ranks are out of step for good, so rank 0 fails every
  request with a clear error, /health says 503,
  and the process exits non-zero for the launcher to restart the ranks (`serve/cli.py`'s
  `_launch`: the one launcher and restart policy, phalanx/launch/worker_launch.py).
  A rank other than 0 that loses rank 0 says so in one line and exits non-zero.

The other ranks ignore SIGTERM and SIGINT (the launcher forwards them to every worker): they
stop when rank 0 tells them, after its own graceful shutdown.
"""

from __future__ import annotations

import re
import signal
import sys
import time

import torch
import torch.distributed as dist

STOP = None
"""What rank 0 sends when it stops serving."""
HEARTBEAT = "heartbeat"
"""What rank 0 sends while idle, so that the other ranks' wait stays within the timeout."""
MESSAGE_DEVICE = torch.device("cpu")
"""The messages go over the group's gloo side also on GPUs ("cpu:gloo,cuda:nccl"): gloo fails at
once when a peer's socket closes, where NCCL would wait for the timeout; and a pickled message
is host data anyway (no copy to the device and back)."""
HEARTBEAT_MAX_S = 1.0
"""The longest gap between heartbeats: a dead rank is noticed within about this long while
idle (one small broadcast a second costs nothing next to a step)."""


class GroupHealth:
    """Rank 0's view of its rank group, which /health and every route read: `failed` is None
    while the ranks are in step, else why this server can no longer serve."""

    def __init__(self):
        self.failed: str | None = None

    def lost(self, error: BaseException) -> str:
        """A step or heartbeat with the other ranks failed: the ranks are out of step for good.
        Marks the group failed and returns the error in one line."""
        why = first_line(error)
        self.failed = (f"a rank of this server failed ({why}); the server is restarting its ranks "
                       "(or exits, with no restarts left): retry shortly")
        return why


def heartbeat_interval(collective_timeout_s: float) -> float:
    return min(HEARTBEAT_MAX_S, collective_timeout_s / 4)


class RankChannel:
    """Rank 0's side: one broadcast (over the default process group) per step, and heartbeats."""

    def __init__(self, heartbeat_s: float = HEARTBEAT_MAX_S):
        self.heartbeat_s = heartbeat_s
        self.last_sent = time.monotonic()

    def send(self, forwards) -> None:
        self.last_sent = time.monotonic()
        dist.broadcast_object_list([forwards], src=0, device=MESSAGE_DEVICE)

    def keep_alive(self) -> None:
        """While idle: a heartbeat when the last message is `heartbeat_s` old."""
        if time.monotonic() - self.last_sent >= self.heartbeat_s:
            self.send(HEARTBEAT)

    def close(self) -> None:
        self.send(STOP)


def follow(runner) -> int:
    """A rank other than 0: run every step rank 0 sends through this rank's runner
    (`model_runner.ModelRunner`, or `dp_engine.DPRunner`: `run_message`), until it stops (0), or
    until the group breaks (1, said in one line)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, device=MESSAGE_DEVICE)
        except RuntimeError as error:  # gloo's and NCCL's errors are RuntimeErrors
            print(f"phalanx: rank {dist.get_rank()} lost rank 0: {first_line(error)}", file=sys.stderr, flush=True)
            return 1
        if box[0] is STOP:
            return 0
        if box[0] == HEARTBEAT:
            continue
        try:
            runner.run_message(box[0])
        except RuntimeError as error:  # a collective of the step with a rank that died (or a bug: its line says)
            print(f"phalanx: rank {dist.get_rank()}: a step failed: {first_line(error)}", file=sys.stderr, flush=True)
            return 1


def first_line(error: BaseException) -> str:
    """An error in one line, without gloo's source location and its boilerplate advice."""
    text = str(error).strip().splitlines()
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text[0]) if text else type(error).__name__
    return line.split(". This is typically caused by")[0]
