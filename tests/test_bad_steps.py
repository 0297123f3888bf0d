"""Steps with a non-finite loss or gradient norm are skipped (no update) and reported; more
than --max-bad-steps in a row stop the run with a checkpoint of the last good state. NaN is
injected as `train`'s `faults` argument (phalanx.train.injected_faults; under the launcher,
the NAN_STEPS_ENV variable, tests/test_restarts.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from phalanx.errors import UserError
from phalanx.testing.fork_ranks import run_ranks
from phalanx.checkpoint.store import latest_checkpoint
from phalanx.train.injected_faults import InjectedFaults
from phalanx.train.loop import train
from phalanx.train.metrics import parse_lines


def _train_or_error(cfg, nan_steps=()):
    try:
        return train(cfg, Path(cfg.out), faults=InjectedFaults(nan_steps=frozenset(nan_steps))).losses
    except UserError as error:
        return str(error)


def _rows(run: Path) -> list[dict]:
    return parse_lines((run / "metrics.jsonl").read_text())[0]


def _weights(folder: Path, scratch: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(str(folder), str(scratch))
    return {k: v for k, v in torch.load(scratch, weights_only=False)["model"].items()}


def test_one_nan_step_is_skipped_and_reported(tiny_config):
    cfg = tiny_config.replace(steps=5, plan="dp=2")
    losses = run_ranks(2, _train_or_error, cfg, [3])[0]
    assert math.isnan(losses[2]) and all(math.isfinite(x) for i, x in enumerate(losses) if i != 2)
    rows = _rows(Path(cfg.out))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2] == {"event": "skipped", "step": 3, "reason": "loss is nan"}
    assert all("loss" in r and r["ckpt_wait_s"] >= 0.0 for i, r in enumerate(rows) if i != 2)
    assert rows[-1]["ckpt_wait_s"] > 0.0 and rows[0]["ckpt_wait_s"] == 0.0  # the final save, and none


def test_six_nan_steps_stop_with_last_good_checkpoint(tiny_config, tmp_path):
    """Steps 3-8 are NaN: five are skipped, the sixth stops the run. Its checkpoint, saved
    from the weights in memory at the stop, must equal step 2 of an unharmed run with the
    same settings (same arithmetic: bit-equal), proving no skipped step moved a weight."""
    cfg = tiny_config.replace(steps=10, ckpt_every=0, keep_checkpoints=5)
    reference = cfg.replace(out=cfg.out + "-ref", ckpt_every=2)
    run_ranks(1, _train_or_error, reference)
    message = run_ranks(1, _train_or_error, cfg, [3, 4, 5, 6, 7, 8])[0]
    assert isinstance(message, str) and "stopped at step 8: 6 steps in a row" in message and "step 2" in message, message
    step, folder = latest_checkpoint(Path(cfg.out))
    assert step == 2
    stopped = _weights(folder, tmp_path / "a.pt")
    good = _weights(Path(reference.out) / "checkpoints" / "step_000002", tmp_path / "b.pt")
    assert stopped.keys() == good.keys() and all(torch.equal(stopped[k], good[k]) for k in good)
    rows = _rows(Path(cfg.out))
    assert [r.get("event") for r in rows] == [None, None] + ["skipped"] * 6


def test_diverging_lr_stops_instead_of_training_on_nan(tiny_config):
    """--lr 1e6: the weights blow up within a few steps; the run must stop, not finish on NaN,
    and no checkpoint of non-finite weights may be written."""
    cfg = tiny_config.replace(lr=1e6, steps=30, ckpt_every=1, keep_checkpoints=3, max_bad_steps=2)
    result = run_ranks(1, _train_or_error, cfg)[0]
    assert isinstance(result, str) and "stopped at step" in result, result
    found = latest_checkpoint(Path(cfg.out))
    if found:  # every checkpoint left holds finite weights
        scratch = Path(cfg.out) / "w.pt"
        assert all(torch.isfinite(v).all() for v in _weights(found[1], scratch).values() if v.is_floating_point())


@pytest.mark.parametrize("lr", ["inf", "nan"])
def test_non_finite_lr_is_refused(lr, tmp_path, capsys):
    from phalanx.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "tiny", "--lr", lr, "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and f"lr={lr} must be a finite number" in err[0], err
