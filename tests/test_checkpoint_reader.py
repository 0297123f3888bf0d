"""One checkpoint reader for every verb that reads a run (train --resume, export, generate):
a damaged checkpoint is never read, `--step N` of a damaged one is refused in one line naming
it damaged, the newest intact one is used otherwise, and a checkpoint of non-finite weights is
refused instead of skipping every step (train) or failing deep in sampling (generate).

Each test here fails if the silent or traceback behaviour of issue 25 comes back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from phalanx.cli import main
from phalanx.testing.cli_errors import assert_cli_error
from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.small_corpus import ONE_FILE_CORPUS
from tests.test_checkpoint_damage import _flip, _no_metadata, _truncate

TRAIN = ["--model", "tiny", "--data", ONE_FILE_CORPUS, "--global-batch", "4", "--seq-len", "16", "--no-progress", "--no-plot",
         "--sample-tokens", "0", "--eval-every", "0", "--device", "cpu", "--nproc", "1"]


def _train(cfg):
    from phalanx.train.loop import train

    train(cfg, Path(cfg.out))


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A 2-step tiny run with a checkpoint after each step."""
    from phalanx.train.config import TrainConfig

    out = tmp_path_factory.mktemp("reader") / "run"
    cfg = TrainConfig(model="tiny", data=ONE_FILE_CORPUS, steps=2, global_batch=4, seq_len=16, warmup_steps=1, eval_every=0,
                      ckpt_every=1, keep_checkpoints=2, sample_tokens=0, progress=False, plot=False, device="cpu", out=str(out),
                      sync_checkpoint=True)
    run_ranks(1, _train, cfg)
    return out


@pytest.fixture
def run(two_checkpoints, tmp_path) -> Path:
    shutil.copytree(two_checkpoints, tmp_path / "run")
    return tmp_path / "run"


def _generate(run: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(run), "--prompt-ids", "1,2,3", "--greedy", "--max-new-tokens", "2", "--json", *extra]


@pytest.mark.parametrize("damage, said", [(_flip, "checksum"), (_truncate, "truncated"), (_no_metadata, ".metadata is missing")])
def test_step_of_a_damaged_checkpoint_is_refused_by_export_and_generate(run, tmp_path, capsys, damage, said):
    damage(run / "checkpoints" / "step_000002")
    out = tmp_path / "exported"
    line = assert_cli_error(["export", str(run), str(out), "--step", "2"], capsys, "is damaged", said, "it has steps 1")
    assert "step_000002" in line
    assert not out.exists()
    assert_cli_error(_generate(run, "--step", "2"), capsys, "is damaged", said)


def test_altered_bytes_are_never_exported_or_generated_from(run, tmp_path, capsys):
    """Flipped bytes in the newest checkpoint: export and generate say so and read the
    previous intact one, whose weights are what comes out."""
    from phalanx.hf.export_run import export_run

    _flip(run / "checkpoints" / "step_000002")
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(run), str(tmp_path / "exported")])
    assert exit_info.value.code == 0
    assert "step_000002 is damaged" in capsys.readouterr().err
    reference = export_run(run, tmp_path / "step1", step=1)
    from safetensors.torch import load_file

    got, want = load_file(tmp_path / "exported" / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)

    with pytest.raises(SystemExit) as exit_info:
        main(_generate(run))
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0 and "step_000002 is damaged" in err and "using step_000001 instead" in err
    assert len(json.loads(out)["new_ids"]) == 2


def test_every_checkpoint_damaged_is_said_as_damaged_not_missing(run, tmp_path, capsys):
    for step in (1, 2):
        _flip(run / "checkpoints" / f"step_{step:06d}")
    assert_cli_error(["export", str(run), str(tmp_path / "x")], capsys, "every checkpoint under", "is damaged",
                     one_line=False, ignore=("phalanx: warning:",))
    assert_cli_error(["train", *TRAIN, "--steps", "3", "--resume", "--out", str(run)], capsys,
                     "--resume: every checkpoint under", "is damaged", one_line=False, ignore=("phalanx: warning:",))


def _poison(run: Path) -> None:
    """A third checkpoint, complete and with a valid manifest, whose weights hold a nan (as an
    older or foreign writer could leave: phalanx's own writer refuses to save one)."""
    from phalanx.model.by_name import model_config
    from phalanx.model.init import build_model, init_weights
    from phalanx.checkpoint.store import save_checkpoint
    from phalanx.train.loop import make_optimizer
    from phalanx.train.config import TrainConfig

    meta = json.loads((run / "checkpoints" / "step_000002" / "phalanx.json").read_text())
    cfg = model_config("tiny")
    model = init_weights(build_model(cfg), cfg, seed=0, device="cpu")
    with torch.no_grad():
        model.layers["1"].attention.wq.weight[0, 0] = float("nan")
    meta = {k: v for k, v in meta.items() if k not in ("step", "manifest")}
    save_checkpoint(run, 3, model, make_optimizer(model, TrainConfig(**meta["train"])), rank=0, keep=3, meta=meta)


def test_non_finite_weights_are_refused_by_train_generate_and_export(run, tmp_path, capsys):
    _poison(run)
    for argv in (["train", *TRAIN, "--steps", "5", "--resume", "--out", str(run)], _generate(run),
                 ["export", str(run), str(tmp_path / "x")]):
        assert_cli_error(argv, capsys, "step_000003 holds non-finite weights (layers.1.attention.wq.weight)",
                         one_line=False, ignore=("phalanx: training",))
    assert not (tmp_path / "x").exists()
    assert "done" not in capsys.readouterr().out


def test_resume_refused_on_an_empty_folder_leaves_it_empty(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert_cli_error(["train", *TRAIN, "--steps", "2", "--resume", "--out", str(tmp_path / "empty")], capsys,
                     "no checkpoint found")
    assert list((tmp_path / "empty").iterdir()) == []
