"""The training loop, run by every rank: setup (run_setup.py), one optimizer step per global
batch (train_step.py), then the end (`end_run`: plots, a sample)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Sequence

from phalanx.train.collective_watch import raise_if_collective_failure
from phalanx.train.config import TrainConfig
from phalanx.train.expert_load_plot import plot_expert_load
from phalanx.train.injected_faults import InjectedFaults
from phalanx.train.job import Job
from phalanx.train.metrics import plot_loss
from phalanx.train.pipeline_step import pipeline_next_logits
from phalanx.train.run_setup import Run, TrainResult, make_optimizer, set_up
from phalanx.train.sample import generate
from phalanx.train.stop_signal import StopSignals
from phalanx.train.train_step import batch_loss, run_step

__all__ = ["TrainResult", "batch_loss", "make_optimizer", "train"]


def train(job: Job | TrainConfig, run_dir: Path, stop: StopSignals | None = None, *,
          faults: InjectedFaults = InjectedFaults(), speeds: Callable[[int], Sequence[float]] | None = None,
          stage_times: Callable[[int], Sequence[float]] | None = None) -> TrainResult:
    """Train on this rank. With a process group, every rank of the group must call this.
    `job`: the run worked out by the launcher (`phalanx.train.job`); given settings instead (a
    user's torchrun, an elastic launch, tests and benchmarks), rank 0 works the job out here
    and every rank receives it (`resume_point.agreed_job`). `stop`: the worker's signal
    handlers; a SIGTERM or SIGINT they note stops every rank after the same step, with a
    checkpoint. `faults`: what a test injects (a killed or stalled rank, NaN steps), the same on
    every rank. `speeds`: a test hook, step -> the per-rank speeds (sequences per second) the
    data-parallel shares adapt to after that step, in place of the measured ones (the same on
    every rank); `stage_times`: the same for a pipeline's split, step -> every rank's compute
    seconds."""
    run = set_up(job, run_dir, stop, faults=faults, speeds=speeds, stage_times=stage_times)
    try:
        while run.step < run.cfg.steps and run_step(run):
            pass
    except RuntimeError as error:
        raise_if_collective_failure(error, run.step + 1, run.cfg.collective_timeout, run.watch)
        raise
    finally:
        close_run(run, failing=sys.exc_info()[0] is not None)
    return end_run(run)


def close_run(run: Run, *, failing: bool) -> None:
    """After the last step, or on an error: what must not be left open."""
    run.rank_clock.close()
    if run.sync is not None and run.sync.energy is not None:
        run.sync.energy.close()
    if run.metrics:
        run.metrics.close()  # flushes the TensorBoard event file
    run.writer.close(failing=failing)  # the last save completes before the run ends
    if run.groups is not None:
        run.groups.shutdown()


def end_run(run: Run) -> TrainResult:
    """After a run that was not stopped by a signal: plots and a sample."""
    cfg, result = run.cfg, run.result
    run.progress.close()
    if result.stopped_by:
        return result  # the launcher says where to continue from
    if run.rank == 0 and cfg.plot and run.writes:
        plot_loss(run.run_dir / "metrics.jsonl", run.run_dir / "loss.png")
        plot_expert_load(run.run_dir / "metrics.jsonl", run.run_dir / "experts.png")
    if cfg.sample_tokens:
        result.sample = generate(
            run.model, cfg.sample_prompt, tokens=cfg.sample_tokens, max_seq_len=run.model_cfg.max_seq_len, device=run.device,
            seed=cfg.seed, pad_to=run.plan.tp if run.plan.sp else 1,
            next_logits=(pipeline_next_logits(run.model, run.mesh, run.model_cfg.vocab_size) if run.pipeline is not None
                         else None),
            tokenizer=run.corpus.tokenizer,
        )
    return result
