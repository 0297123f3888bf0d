"""Checkpoints with torch.distributed.checkpoint (DCP): each rank writes its own shards.

A checkpoint is written to `step_NNNNNN.tmp/`; when every rank has finished, rank 0 writes
phalanx.json with the manifest of the files (manifest.py) and renames the folder,
so an interrupted save never hides the previous good checkpoint. Loading takes the newest
checkpoint whose files match their manifest and says which damaged ones it passed over. DCP
reshards on load, so a run may resume with another layout (saved with fsdp on 4 ranks,
loaded on 2). Which checkpoint to load (intact, newest or `--step`): reader.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from phalanx.checkpoint.manifest import META_FILE, build_manifest, read_meta
from phalanx.checkpoint.reader import RunCheckpoints, latest_checkpoint  # noqa: F401 (latest_checkpoint: re-exported)
from phalanx.errors import UserError
from phalanx.parallel.expert_checkpoint import globalize_experts

# DCP warns on every save and load without a process group; one process is a supported case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def _prune(run_dir: Path, keep: int, newest: Path) -> None:
    """Keep the `keep` newest complete checkpoints by step. Only `newest` (just written and
    checked finite) and checkpoints whose files match their manifest count as good, so a good
    checkpoint is never deleted to make room for one not known good; damaged folders are left
    for a person to look at."""
    good = [c.path for c in RunCheckpoints.scan(run_dir).intact]
    if newest not in good:  # just written and checked finite; cannot be newer-than-newest
        good = [newest, *good]
    for old in good[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def checkpoint_state(model: nn.Module, optimizer) -> dict:
    """What a checkpoint holds: model and optimizer state (every expert once, see
    expert_checkpoint.py). Nothing else is needed to continue the run: the learning rate is a
    function of the step, a step's batch a function of (seed, step) recorded in phalanx.json,
    and training draws no other random numbers (no dropout), so there is no RNG state to keep."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return globalize_experts(model, {"model": model_state, "optim": optim_state})[0]


def begin_save(run_dir: Path, step: int, *, rank: int) -> Path:
    """The staging folder of the checkpoint of `step`, emptied of what a crashed save left."""
    staging = checkpoint_dir(run_dir, step).with_suffix(".tmp")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    _barrier()
    return staging


def finish_save(run_dir: Path, step: int, staging: Path, *, keep: int, meta: dict | None,
                die_in_save: int | None = None) -> Path:
    """Rank 0, once every rank's shards and DCP's .metadata are written: the manifest, then the
    rename that makes the checkpoint count, then pruning. Before the rename the folder ends in
    .tmp and is never read, so a crash anywhere in a save leaves the previous checkpoint newest.
    `die_in_save`: a test's injected fault (injected_faults.py): rank 0 SIGKILLs itself here,
    after DCP wrote its files and before the manifest, when saving that step."""
    if die_in_save == step:
        os.kill(os.getpid(), signal.SIGKILL)
    final = checkpoint_dir(run_dir, step)
    # Written last, after every shard is complete: a folder without a valid manifest is unfinished.
    record = {"step": step, **(meta or {}), "manifest": build_manifest(staging)}
    (staging / META_FILE).write_text(json.dumps(record))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    _prune(run_dir, keep, final)
    return final


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer, *, rank: int, keep: int,
                    meta: dict | None = None, die_in_save: int | None = None) -> Path:
    """Save the state after `step` completed steps and return when it is complete (all ranks
    call this). `meta` goes into phalanx.json beside the step (the model's config and the run's
    settings, for export and resume). checkpoint_writer.py saves in the background instead."""
    staging = begin_save(run_dir, step, rank=rank)
    dcp.save(checkpoint_state(model, optimizer), checkpoint_id=str(staging))
    _barrier()
    if rank == 0:
        finish_save(run_dir, step, staging, keep=keep, meta=meta, die_in_save=die_in_save)
    _barrier()
    return checkpoint_dir(run_dir, step)


DIE_IN_SAVE_ENV = "PHALANX_TEST_DIE_IN_SAVE"
"""Test hook: a step number; rank 0 SIGKILLs itself while saving that step's checkpoint, after
DCP wrote its files and before the manifest (a crash in the middle of a save). Read once by
`train.injected_faults.InjectedFaults.from_env`, passed down as `die_in_save`."""


def load_checkpoint(path: Path, model: nn.Module, optimizer) -> int:
    """Load model and optimizer state in place; return the step it was saved after."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state, restore = globalize_experts(model, {"model": model_state, "optim": optim_state})
    dcp.load(state, checkpoint_id=str(path))
    state = restore()
    settings = [dict(group) for group in optimizer.param_groups]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # On the first stage of a pipeline, DCP gives the param groups back without their numbers
    # (lr, betas, eps, weight_decay: Adam then fails on 'betas'); they are the run's settings
    # (the lr is set again each step), so put back what is missing.
    for group, own in zip(optimizer.param_groups, settings):
        for key, value in own.items():
            group.setdefault(key, value)
    refuse_non_finite(model, path)
    return read_meta(path)["step"]


def load_model_weights(path: Path, model: nn.Module, *, tied: bool = False) -> None:
    """Only the model part of the checkpoint at `path`, into `model` of any layout (export and
    generation; the optimizer state is not read). `tied`: the output projection shares the
    embedding's matrix, which the checkpoint holds once, under the embedding's name."""
    state = get_model_state_dict(model)
    if tied:
        state.pop("output.weight", None)
    wrapped, restore = globalize_experts(model, {"model": state, "optim": {}})  # all ep ranks' experts
    dcp.load({"model": wrapped["model"]}, checkpoint_id=str(path))
    set_model_state_dict(model, restore()["model"], options=StateDictOptions(strict=False))
    refuse_non_finite(model, path)


def refuse_non_finite(model: nn.Module, path: Path) -> None:
    """A UserError on every rank when any rank's loaded weights hold nan or inf (collective).
    The manifest only says the files are the ones written; phalanx never saves such weights,
    but an older or foreign writer may have, and training on them would skip every step,
    generating from them would fail deep in sampling."""
    params = list(model.named_parameters())
    device = params[0][1].device if params else torch.device("cpu")
    if weights_finite(model, device):
        return
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731
    bad = next((name for name, p in params if not bool(torch.isfinite(local(p)).all())), None)
    which = f" ({bad})" if bad else " (in another rank's part)"
    raise UserError(f"checkpoint {path} holds non-finite weights{which}; it cannot be used: pick an earlier one "
                    f"(--step N), or remove it")


@torch.no_grad()
def weights_finite(model, device: torch.device) -> bool:
    """Whether every rank's parameters are all finite (collective: every rank calls it).
    A checkpoint of non-finite weights would be worse than none: it would push good ones out."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    flag = torch.tensor(float(all(bool(torch.isfinite(p).all()) for p in local)), device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
