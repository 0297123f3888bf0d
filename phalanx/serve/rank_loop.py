"""Serving over several ranks (`--nproc N --plan tp=N`): rank 0 runs HTTP and the scheduler,
and before every forward sends the other ranks its plain-data description (`engine.Forward`:
token ids, block tables, positions, which logits are read), so every rank runs the same
forward, collectives included, on its own slice of the weights and its own kv heads.
Sampling happens on rank 0 only (every rank holds the gathered logits anyway).
Under attention data parallelism (`--plan dp=N,ep=N`) the message holds each dp rank's own
forwards instead, and the logits come back to rank 0 (`dp_engine.py`).

The other ranks ignore SIGTERM and SIGINT (the launcher forwards them to every worker): they
stop when rank 0 tells them, after its own graceful shutdown.
"""

from __future__ import annotations

import signal

import torch.distributed as dist

STOP = None
"""What rank 0 sends when it stops serving."""


class RankChannel:
    """Rank 0's side: one broadcast (over the default process group) per step."""

    def send(self, forwards) -> None:
        dist.broadcast_object_list([forwards], src=0)

    def close(self) -> None:
        self.send(STOP)


def follow(engine) -> None:
    """A rank other than 0: run every forward rank 0 sends, until it stops."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is STOP:
            return
        engine.run_order(box[0])
