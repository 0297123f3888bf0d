"""Checkpoints saved while training goes on (DCP `async_save`), or in the loop with
`--sync-checkpoint`.

An asynchronous save copies the state to CPU memory (the loop waits for that copy only), then a
background thread writes the files while the next steps run. Its collectives go through a gloo
group of its own, so they never interleave with training's (and on CUDA, where training talks
NCCL, DCP still has the CPU-capable group it needs). On rank 0 a second thread waits for the
write to finish on every rank (DCP's .metadata is written only then) and finishes the save
like a synchronous one: manifest, rename, pruning (checkpoint.finish_save). So a checkpoint
counts only once complete, and a crash at any point leaves the previous one the newest.

One save is in flight at a time: the next waits for the previous (its row's `ckpt_wait_s` is
that wait plus the copy), and `close` waits for the last before the run ends.
"""

from __future__ import annotations

import contextlib
import datetime
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from phalanx.errors import UserError
from phalanx.checkpoint.store import begin_save, checkpoint_state, finish_save, save_checkpoint, weights_finite


class CheckpointWriter:
    """Saves the state of `model` and `optimizer` after a step; every rank makes the same calls.
    A new process group is made here when asynchronous: construct it on every rank, in order."""

    def __init__(self, run_dir: Path, model, optimizer, *, device: torch.device, rank: int, keep: int, meta: dict,
                 asynchronous: bool, timeout_s: float, die_in_save: int | None = None):
        """`die_in_save`: a test's injected fault, the step whose save rank 0 dies in (store.finish_save)."""
        self.run_dir, self.model, self.optimizer, self.device = run_dir, model, optimizer, device
        self.rank, self.keep, self.meta, self.asynchronous = rank, keep, meta, asynchronous
        self.die_in_save = die_in_save
        self.group = None
        if asynchronous and dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.finisher = ThreadPoolExecutor(1, thread_name_prefix="phalanx-ckpt") if asynchronous and rank == 0 else None
        self.pending: tuple[int, Future] | None = None
        """The step of the save in flight and its future."""
        self.last_saved = -1
        """The step of the newest save started (-1: none); the caller sets it after a resume."""

    def save(self, step: int) -> tuple[float, bool]:
        """Checkpoint the state after `step` steps unless it is not finite; return (seconds the
        loop waited, whether a save was started)."""
        began = time.perf_counter()
        if not weights_finite(self.model, self.device):
            if self.rank == 0:
                print(f"phalanx: warning: not checkpointing step {step}: the weights are not finite", file=sys.stderr)
            return time.perf_counter() - began, False
        self.wait()
        self.last_saved = step
        if not self.asynchronous:
            with self._disk_errors(step):
                save_checkpoint(self.run_dir, step, self.model, self.optimizer, rank=self.rank, keep=self.keep, meta=self.meta,
                                die_in_save=self.die_in_save)
            return time.perf_counter() - began, True
        staging = begin_save(self.run_dir, step, rank=self.rank)
        # Returns once the state is copied to CPU memory; the optimizer may then change it.
        written = dcp.async_save(checkpoint_state(self.model, self.optimizer), checkpoint_id=str(staging),
                                 process_group=self.group)
        if self.finisher is None:
            self.pending = step, written
        else:
            # A copy of meta as it is now: the loop updates entries (the expert placement) between saves.
            self.pending = step, self.finisher.submit(self._finish, written, step, staging, dict(self.meta))
        return time.perf_counter() - began, True

    def _finish(self, written: Future, step: int, staging: Path, meta: dict) -> None:
        written.result()  # every rank's files and DCP's .metadata are on disk
        finish_save(self.run_dir, step, staging, keep=self.keep, meta=meta, die_in_save=self.die_in_save)

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise what it raised."""
        pending, self.pending = self.pending, None
        if pending is not None:
            with self._disk_errors(pending[0]):
                pending[1].result()

    @contextlib.contextmanager
    def _disk_errors(self, step: int):
        """A save that the file system refused (a full disk, a lost mount) is a one-line error:
        the previous complete checkpoint is still there to resume from."""
        try:
            yield
        except (Exception, CheckpointException) as error:
            problem = _file_system_problem(error, self.run_dir / "checkpoints")
            if problem is None:
                raise
            raise UserError(f"the checkpoint of step {step} could not be written under {self.run_dir / 'checkpoints'} "
                            f"({problem}); the previous complete checkpoint is kept: free space "
                            "and continue with --resume auto") from None

    def close(self, *, failing: bool = False) -> None:
        """Wait for the last save, so the run ends with its checkpoint complete. `failing`: the
        run is ending on an error; a failure of the save then is not reported, so that the
        run's own error is the one the user reads (when another rank died, every survivor's save
        fails too: noise). What the launcher then names is the newest complete checkpoint."""
        try:
            self.wait()
        except (Exception, CheckpointException):
            if not failing:
                raise
        finally:
            if self.finisher is not None:
                self.finisher.shutdown()


def _file_system_problem(error: BaseException, folder: Path) -> str | None:
    """Why the file system refused a save, or None when the error is something else. An OSError
    says it (raised here, or on a rank DCP reports); torch's file writer loses the errno ("unexpected
    pos 704 vs 598"), so any failure with the disk (nearly) full is taken to be that."""
    failures = [failure for failure, _ in error.failures.values()] if isinstance(error, CheckpointException) else [error]
    for failure in failures:
        if isinstance(failure, OSError):
            return failure.strerror or str(failure)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    return f"No space left on device: {free} bytes free" if free < 2**20 else None
