"""Damaged checkpoints: the manifest in phalanx.json (sizes and BLAKE2b checksums) catches a
truncated file, flipped bytes, missing DCP metadata and a garbage phalanx.json; loading falls
back to the newest complete checkpoint and says which one it passed over. Pruning goes by the
step recorded in phalanx.json and never removes a good checkpoint for a damaged one."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint import store as checkpoint
from phalanx.checkpoint.store import latest_checkpoint, save_checkpoint
from phalanx.cli import main
from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.small_corpus import ONE_FILE_CORPUS
from phalanx.train.loop import train


def _losses(cfg):
    return train(cfg, Path(cfg.out)).losses


@pytest.fixture(scope="module")
def four_checkpoints(tmp_path_factory):
    """One 4-step run with a checkpoint after every step, and its losses."""
    from phalanx.train.config import TrainConfig

    out = tmp_path_factory.mktemp("damage") / "run"
    cfg = TrainConfig(model="tiny", data=ONE_FILE_CORPUS, steps=4, global_batch=8, seq_len=32, warmup_steps=1, eval_every=0, ckpt_every=1,
                      keep_checkpoints=4, sample_tokens=0, progress=False, plot=False, device="cpu", out=str(out))
    return cfg, run_ranks(1, _losses, cfg)[0]


def _copy(cfg, tmp_path):
    shutil.copytree(cfg.out, tmp_path / "run")
    return cfg.replace(out=str(tmp_path / "run")), tmp_path / "run" / "checkpoints"


def _biggest_file(folder: Path) -> Path:
    return max((p for p in folder.iterdir() if p.name.endswith(".distcp")), key=lambda p: p.stat().st_size)


def _truncate(folder):
    path = _biggest_file(folder)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(folder):
    path = _biggest_file(folder)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _no_metadata(folder):
    (folder / ".metadata").unlink()


def _garbage_json(folder):
    (folder / "phalanx.json").write_text('{"step": 4, "mod')


@pytest.mark.parametrize("damage, said", [
    (_truncate, "truncated"), (_flip, "checksum"), (_no_metadata, ".metadata is missing"), (_garbage_json, "not valid JSON"),
])
def test_damaged_newest_falls_back_to_previous(four_checkpoints, tmp_path, capsys, damage, said):
    cfg, _ = four_checkpoints
    cfg, ckpts = _copy(cfg, tmp_path)
    damage(ckpts / "step_000004")
    assert latest_checkpoint(Path(cfg.out), report=True) == (3, ckpts / "step_000003")
    err = capsys.readouterr().err
    assert "step_000004 is damaged" in err and said in err and "using step_000003 instead" in err, err


def test_resume_skips_damaged_checkpoint_and_reproduces_losses(four_checkpoints, tmp_path):
    """Resuming from step 3 (the truncated step-4 checkpoint passed over) replays step 4 with
    the same arithmetic as the uninterrupted run: equal losses."""
    cfg, full = four_checkpoints
    cfg, ckpts = _copy(cfg, tmp_path)
    _truncate(ckpts / "step_000004")
    assert run_ranks(1, _losses, cfg.replace(resume="must"))[0] == full[3:]


def test_crash_during_save_leaves_previous_loadable(four_checkpoints, tmp_path, monkeypatch):
    """A save that dies after DCP wrote its files but before phalanx.json (here: the manifest
    step raises) leaves only a .tmp folder; the previous checkpoint is still the newest."""
    cfg, _ = four_checkpoints
    cfg, ckpts = _copy(cfg, tmp_path)

    def crash(folder):
        raise OSError("disk died")

    monkeypatch.setattr(checkpoint, "build_manifest", crash)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(OSError):
        save_checkpoint(Path(cfg.out), 5, model, torch.optim.AdamW(model.parameters()), rank=0, keep=2)
    assert (ckpts / "step_000005.tmp" / ".metadata").exists()
    assert latest_checkpoint(Path(cfg.out)) == (4, ckpts / "step_000004")


def test_garbage_phalanx_json_does_not_block_a_fresh_run(tmp_path):
    folder = tmp_path / "r" / "checkpoints" / "step_000002"
    folder.mkdir(parents=True)
    (folder / "phalanx.json").write_text("garbage")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "tiny", "--steps", "2", "--global-batch", "4", "--seq-len", "16", "--no-progress", "--no-plot",
              "--sample-tokens", "0", "--eval-every", "0", "--device", "cpu", "--nproc", "1", "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 0
    assert latest_checkpoint(tmp_path / "r")[0] == 2


def _save(run_dir: Path, step: int, keep: int = 2) -> None:
    model = torch.nn.Linear(2, 2)
    save_checkpoint(run_dir, step, model, torch.optim.AdamW(model.parameters()), rank=0, keep=keep)


def test_pruning_orders_by_step_past_a_million(tmp_path):
    """`step_1000000` sorts before `step_999999` as text; pruning must keep the newest two."""
    for step in (999_998, 999_999, 1_000_000):
        _save(tmp_path, step)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1000000", "step_999999"]
    assert latest_checkpoint(tmp_path)[0] == 1_000_000


def test_pruning_never_removes_a_good_checkpoint_for_a_damaged_one(tmp_path):
    for step in (1, 2):
        _save(tmp_path, step)
    _flip(tmp_path / "checkpoints" / "step_000002")
    _save(tmp_path, 3)  # keep=2 good ones: 3 and 1; the damaged 2 does not count and is left alone
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002", "step_000003"]


@pytest.mark.parametrize("asynchronous", [True, False])
def test_full_disk_during_a_save_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch, asynchronous):
    """The disk fills up while DCP writes step 2 (its fsync fails with ENOSPC, as a full disk
    reports it): a UserError naming the step and the cause, in the background save at the
    next wait as in the loop, and step 1 is still the newest complete checkpoint."""
    from phalanx.checkpoint.writer import CheckpointWriter
    from phalanx.errors import UserError

    model = torch.nn.Linear(2, 2)
    writer = CheckpointWriter(tmp_path, model, torch.optim.AdamW(model.parameters()), device=torch.device("cpu"),
                              rank=0, keep=2, meta={}, asynchronous=asynchronous, timeout_s=10)
    writer.save(1)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer.wait()
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError, match=r"checkpoint of step 2 could not be written under .* \(No space left on device\); "
                                        "the previous complete checkpoint is kept"):
        writer.save(2)
        writer.close()
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path)[0] == 1
