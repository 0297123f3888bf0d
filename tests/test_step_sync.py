"""Each step's one small collective (`phalanx.train.step_sync`): the global loss, the stop
signal and every rank's peak memory in one all-reduce, and what the ranks do with it.

Exact comparisons: the packed values are small integers and float32 losses summed in
float64, so the sums are exact and the mean is the one float division of the reference."""

from __future__ import annotations

import signal
from pathlib import Path

import torch

from phalanx.testing.fork_ranks import run_ranks
from phalanx.train.metrics import parse_lines


def _agree(got: dict[int, int]):
    import torch.distributed as dist

    from phalanx.train.step_sync import StepSync
    from phalanx.train.stop_signal import StopSignals

    rank = dist.get_rank()
    stop = StopSignals()
    stop.received = got.get(rank, 0)
    sync = StepSync(torch.device("cpu"), stop)
    before = sync.stop_before_step()  # no step has run yet: never a stop
    agreed = sync.agree(torch.tensor(float(rank + 1)), peak_mb=100.0 + rank)
    return before, agreed.loss, agreed.stop, agreed.peak_mb_by_rank, sync.stop_before_step()


def test_one_all_reduce_gives_loss_stop_and_peaks_to_every_rank():
    """3 ranks with losses 1, 2, 3: the mean 2 everywhere; rank 1 got SIGINT and rank 2 SIGTERM:
    every rank stops for SIGTERM; each rank's peak in its own slot."""
    results = run_ranks(3, _agree, {1: signal.SIGINT, 2: signal.SIGTERM})
    assert results == [(0, 2.0, signal.SIGTERM, [100.0, 101.0, 102.0], signal.SIGTERM)] * 3
    results = run_ranks(2, _agree, {1: signal.SIGINT})
    assert results == [(0, 1.5, signal.SIGINT, [100.0, 101.0], signal.SIGINT)] * 2
    assert run_ranks(2, _agree, {}) == [(0, 1.5, 0, [100.0, 101.0], 0)] * 2


def test_one_process_needs_no_collective():
    """No process group: the loss as is, the handlers' own signal, no per-rank peaks."""
    from phalanx.train.step_sync import StepSync
    from phalanx.train.stop_signal import StopSignals

    stop = StopSignals()
    sync = StepSync(torch.device("cpu"), stop)
    agreed = sync.agree(torch.tensor(0.25), peak_mb=5.0)
    assert (agreed.loss, agreed.stop, agreed.peak_mb_by_rank, sync.stop_before_step()) == (0.25, 0, None, 0)
    stop.received = signal.SIGINT  # noted after the step's agreement: one process asks its handlers
    assert sync.stop_before_step() == signal.SIGINT


def _train_with_signal_on_rank_1(cfg):
    import torch.distributed as dist

    from phalanx.train.loop import train
    from phalanx.train.stop_signal import StopSignals

    stop = StopSignals()
    if dist.get_rank() == 1:
        stop.received = signal.SIGTERM  # as if it arrived during setup, on this rank only
    result = train(cfg, Path(cfg.out), stop=stop)
    return result.stopped_by, result.steps_done


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(tiny_config):
    """dp=2: rank 1 alone has SIGTERM before the first step. Step 1 runs (a signal during setup
    still lets one step run), its collective tells rank 0, and both stop after step 1 with
    the step-1 checkpoint; metrics.jsonl has that one step."""
    from phalanx.checkpoint.store import latest_checkpoint

    cfg = tiny_config.replace(plan="dp=2", steps=4, ckpt_every=0)
    assert run_ranks(2, _train_with_signal_on_rank_1, cfg) == [(signal.SIGTERM, 1)] * 2
    assert latest_checkpoint(Path(cfg.out))[0] == 1
    assert [row["step"] for row in parse_lines((Path(cfg.out) / "metrics.jsonl").read_text())[0]] == [1]
