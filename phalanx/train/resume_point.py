"""Where a run starts, found on disk, and the job every rank of a group agrees on.

* `saved_checkpoint(run_dir)`: the newest complete checkpoint with its phalanx.json (reading it
  checksums every file, so it is done once: by the launcher, or by rank 0).
* `agreed_job(cfg, run_dir)`: for workers that were given settings rather than a job (a user's
  torchrun, an elastic launch whose world size only the workers know, a test or benchmark
  calling `train` with a TrainConfig): rank 0 works the job out (`job.resolve_job`) and sends
  it to the other ranks, so every rank runs the same plan from the same checkpoint; an error
  rank 0 meets is raised on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from phalanx.errors import UserError
from phalanx.checkpoint.store import latest_checkpoint
from phalanx.checkpoint.manifest import read_meta
from phalanx.train.config import TrainConfig
from phalanx.train.job import Job, SavedCheckpoint, resolve_job


def saved_checkpoint(run_dir: Path, *, report: bool = False) -> SavedCheckpoint | None:
    """The newest complete checkpoint under `run_dir` and its record, if any; with `report`,
    each damaged one passed over is named on stderr."""
    found = latest_checkpoint(run_dir, report=report)
    return SavedCheckpoint(step=found[0], path=str(found[1]), meta=read_meta(found[1])) if found else None


def gpu_name(cfg: TrainConfig) -> str:
    """This machine's GPU, for `--plan auto` without `--cluster` ("" on CPU, and for any other
    plan: asking initializes CUDA in this process, which a launcher should not hold)."""
    if cfg.plan == "auto" and not cfg.cluster and cfg.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return ""


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def local_job(cfg: TrainConfig, run_dir: Path, world_size: int) -> Job:
    """The job of `cfg` on `world_size` processes, worked out in this process (saying its lines)."""
    found = saved_checkpoint(run_dir, report=True) if cfg.resume else None
    return resolve_job(cfg, world_size, found, run_dir=str(run_dir), gpu=gpu_name(cfg), log=_say)


def agreed_job(cfg: TrainConfig, run_dir: Path) -> Job:
    """The job every rank of the process group runs (collective: every rank calls it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local_job(cfg, run_dir, 1)
    payload: list = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            payload[0] = local_job(cfg, run_dir, dist.get_world_size())
        except UserError as exc:
            payload[0], error = ("user error", str(exc)), exc
        except Exception as exc:  # a bug: the other ranks must not wait for a job that never comes
            payload[0], error = ("failed", f"{type(exc).__name__}: {exc}"), exc
    dist.broadcast_object_list(payload, src=0)  # gloo under a mixed cpu:gloo,cuda:nccl group
    if error is not None:
        raise error
    if isinstance(payload[0], tuple):
        kind, message = payload[0]
        if kind == "user error":
            raise UserError(message)  # said once, by rank 0 (worker_group.run_in_group)
        raise RuntimeError(f"rank 0 could not work out the run: {message}")
    return payload[0]
