"""Moving a pipeline's layers between its stages mid-run, by the path an elastic re-plan takes:
the state after the step is checkpointed, the model is built again for the new plan (the same
plan with another `split`), and the checkpoint is loaded into it, resharded by DCP as a resume
on another layout would be. Nothing is lost: the run goes on with the next step, from the
weights and optimizer moments of the one it just finished (the checkpoint is an ordinary one,
kept and pruned like the others). Checkpoints written after it record the split
(`stage_split` in phalanx.json), and a resume starts from it (`job.resolve_job`).

When: `adapt_policy.SplitGovernor` decides from the stages' measured compute times, on every
rank alike; the re-split runs after the step's update and checkpoint, on every rank (collective).
What it cost (every rank's slowest) is what the next decision weighs a re-split at.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from phalanx.checkpoint.store import checkpoint_dir, load_checkpoint
from phalanx.train.run_setup import Run, build_model


def resplit(run: Run, done: int) -> float:
    """Re-split `run`'s pipeline into `run.splitter.pending` layers per stage after `done`
    steps; returns the seconds it took on the slowest rank (0.0: not done, the weights are
    not finite and were not saved)."""
    began = time.perf_counter()
    counts = run.splitter.pending
    if run.writer.last_saved != done and not run.writer.save(done)[1]:
        run.splitter.pending = None  # weights not finite (every rank sees the same): no state to move
        return 0.0
    run.writer.wait()  # this rank's files written (rank 0: the checkpoint renamed into place too)
    if dist.is_initialized():
        dist.barrier()  # ... on every rank, before any reads it
    split = ":".join(map(str, counts))
    run.job = dataclasses.replace(run.job, plan=run.plan.replace(split=split))
    run.mesh = dataclasses.replace(run.mesh, plan=run.mesh.plan.replace(split=split))  # the same process groups
    run.meta["stage_split"] = split  # the next checkpoints' phalanx.json: a resume starts from it (job.py)
    run.model = run.pipeline = run.optimizer = None  # the old stages' memory goes before the new ones are built
    build_model(run)
    load_checkpoint(checkpoint_dir(run.run_dir, done), run.model, run.optimizer)
    run.writer.model, run.writer.optimizer = run.model, run.optimizer
    seconds = torch.tensor(time.perf_counter() - began, dtype=torch.float64, device=run.device)
    if dist.is_initialized():
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    run.splitter.applied(float(seconds))
    return float(seconds)
