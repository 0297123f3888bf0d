"""Resuming from a checkpoint continues the same run.

The batch of a step depends only on (seed, step) and the learning rate only on the step, so
after loading model and optimizer state the resumed steps must reproduce the uninterrupted
run's losses: exactly within one layout (same arithmetic, same order), and to the dp tolerance
of test_data_parallel (1e-4) when the checkpoint is loaded into another layout (DCP reshards).

Checkpoints are saved in the background by default (checkpoint/writer.py): the step-3 save is
written while steps 4 and 5 change the weights, so equal losses and final weights also show
that the save holds the state of its own step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from phalanx.testing.fork_ranks import run_ranks
from phalanx.checkpoint.store import latest_checkpoint
from phalanx.train.loop import train
from phalanx.train.metrics import read_metrics


def _losses(cfg):
    return train(cfg, Path(cfg.out)).losses


def _losses_and_weights(cfg):
    result = train(cfg, Path(cfg.out))
    return result.losses, {name: value.detach().clone() for name, value in result.model.state_dict().items()}


def _interrupt_after(run_dir: Path, step: int) -> None:
    """Make run_dir look like a run stopped just after the checkpoint of `step`."""
    for path in (run_dir / "checkpoints").glob("step_*"):
        if json.loads((path / "phalanx.json").read_text())["step"] > step:
            shutil.rmtree(path)


def test_resume_reproduces_uninterrupted_losses(tiny_config):
    cfg = tiny_config.replace(steps=6, ckpt_every=3)
    full, full_weights = run_ranks(1, _losses_and_weights, cfg)[0]
    _interrupt_after(Path(cfg.out), 3)
    assert latest_checkpoint(Path(cfg.out))[0] == 3
    resumed, weights = run_ranks(1, _losses_and_weights, cfg.replace(resume=True))[0]
    assert resumed == full[3:]
    assert all(torch.equal(weights[name], value) for name, value in full_weights.items())
    # metrics.jsonl reads as one continuous run: steps 1..6 once each.
    assert [r["step"] for r in read_metrics(Path(cfg.out) / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_resume_fsdp_checkpoint_on_other_layout(tiny_config):
    cfg = tiny_config.replace(steps=6, ckpt_every=3)
    reference = run_ranks(1, _losses, cfg.replace(out=cfg.out + "-ref"))[0]
    run_ranks(2, _losses, cfg.replace(plan="dp=2,fsdp=true"))
    _interrupt_after(Path(cfg.out), 3)
    for plan, world in (("dp=1", 1), ("dp=2", 2)):
        resumed = run_ranks(world, _losses, cfg.replace(resume=True, plan=plan))[0]
        assert max(abs(a - b) for a, b in zip(resumed, reference[3:])) < 1e-4, (plan, resumed, reference)
        _interrupt_after(Path(cfg.out), 3)
