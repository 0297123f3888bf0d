"""A stuck rank ends the run within --collective-timeout, naming the barrier and the rank.

With a 5 s timeout, a rank that stalls before a step's boundary barrier (test hook STALL_ENV,
sleeping 120 s) makes rank 0 fail within 25 s (5 s of timeout plus start-up), with an error
that names the operation and the missing rank, instead of hanging. (The timeout is what the
test waits out: 5 s is short, yet far above the ranks' skew at that barrier when none stalls.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from phalanx.testing.fork_ranks import run_ranks
from phalanx.train.collective_watch import STALL_ENV
from phalanx.train.loop import train


def _train(cfg):
    return train(cfg, Path(cfg.out)).losses


def test_stalled_rank_is_named_within_the_collective_timeout(tiny_config, monkeypatch):
    monkeypatch.setenv(STALL_ENV, "1:1:120")  # rank 1 sleeps before step 1's barrier
    began = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        run_ranks(2, _train, tiny_config.replace(steps=1, collective_timeout=5.0))
    assert time.monotonic() - began < 25
    assert ("CollectiveTimeout: rank 0: the step-boundary barrier before step 1 did not complete within 5 s "
            "(--collective-timeout): [Rank 0]: Ranks 1 failed to pass monitoredBarrier") in str(error.value), error.value
