"""Checkpoints with torch.distributed.checkpoint (DCP): each rank writes its own shards.

A checkpoint is written to `step_NNNNNN.tmp/` and renamed when every rank has finished, so an
interrupted save never hides the previous good checkpoint. DCP reshards on load, so a run may
resume with another layout (for example, saved with fsdp on 4 ranks, loaded on 2).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from phalanx.parallel.expert_checkpoint import globalize_experts


# DCP warns on every save and load without a process group; one process is a supported case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint (step, path) under run_dir, if any."""
    found = []
    for path in (run_dir / "checkpoints").glob("step_*"):
        if path.suffix != ".tmp" and (path / "phalanx.json").exists():
            found.append((json.loads((path / "phalanx.json").read_text())["step"], path))
    return max(found) if found else None


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer, *, rank: int, keep: int,
                    meta: dict | None = None) -> Path:
    """Save the state after `step` completed steps (all ranks call this). `meta` goes into
    phalanx.json beside the step (the model's config and the run's settings, for export)."""
    final = checkpoint_dir(run_dir, step)
    staging = final.with_suffix(".tmp")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    state, _ = globalize_experts(model, {"model": model_state, "optim": optim_state})  # all ep ranks' experts
    dcp.save(state, checkpoint_id=str(staging))
    _barrier()
    if rank == 0:
        (staging / "phalanx.json").write_text(json.dumps({"step": step, **(meta or {})}))
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        for old in sorted((run_dir / "checkpoints").glob("step_*"))[:-keep]:
            if old.suffix != ".tmp":
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer) -> int:
    """Load model and optimizer state in place; return the step it was saved after."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state, restore = globalize_experts(model, {"model": model_state, "optim": optim_state})
    dcp.load(state, checkpoint_id=str(path))
    state = restore()
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads((path / "phalanx.json").read_text())["step"]
