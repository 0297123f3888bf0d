"""A run killed while saving, continued on another number of processes (a node lost, a rerun
with another --nproc): the previous checkpoint is intact, the plan follows the world size and
DCP reshards the checkpoint, so the losses go on.

One 4-process run (dp=2,tp=2; checkpoints saved in the background, the default) has rank 0
SIGKILLed in the middle of its last save (`InjectedFaults(die_in_save=3)`: after DCP wrote the shards,
before the manifest): the step-2 checkpoint must stay the newest and load. It is resumed on 2
processes with the same plan (dp follows: dp=1,tp=2) and with `--plan auto`. Step 3 must give
the killed run's step-3 loss: the batch of a step and the learning rate depend only on the
step and the global batch is unchanged, so only the order of float32 sums differs between
layouts, within 1e-4 as in test_resume.py. A plan that cannot follow (tp=2 does not divide 3
processes) is refused in one line naming one that does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from phalanx.testing.cli_errors import assert_cli_error
from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.small_corpus import ONE_FILE_CORPUS
from phalanx.checkpoint.store import latest_checkpoint
from phalanx.train.injected_faults import InjectedFaults
from phalanx.train.loop import train
from phalanx.train.world_change import dp_follows
from phalanx.plan import Plan


def _losses(cfg):
    return train(cfg, Path(cfg.out)).losses


def _losses_to_file(cfg):
    """Rank 0 is killed in step 3's save: the other ranks (same global-mean losses) leave theirs in a file."""
    import torch.distributed as dist

    losses = train(cfg, Path(cfg.out), faults=InjectedFaults(die_in_save=3)).losses
    Path(f"{cfg.out}.losses.rank{dist.get_rank()}").write_text(json.dumps(losses))


@pytest.fixture(scope="module")
def four_process_run(tmp_path_factory):
    from phalanx.train.config import TrainConfig

    out = tmp_path_factory.mktemp("world") / "run"
    cfg = TrainConfig(model="tiny", data=ONE_FILE_CORPUS, steps=3, global_batch=8, seq_len=32, lr=3e-3, warmup_steps=1, eval_every=0,
                      ckpt_every=2, sample_tokens=0, progress=False, plot=False, device="cpu", plan="dp=2,tp=2", out=str(out))
    with pytest.raises(RuntimeError, match="rank 0: died without a result"):
        run_ranks(4, _losses_to_file, cfg)
    return cfg, json.loads(Path(f"{out}.losses.rank1").read_text())


def test_kill_during_a_background_save_leaves_the_previous_checkpoint(four_process_run):
    cfg, losses = four_process_run
    ckpts = Path(cfg.out) / "checkpoints"
    assert len(losses) == 3
    assert (ckpts / "step_000003.tmp" / ".metadata").exists()  # the save was under way: every shard written
    assert latest_checkpoint(Path(cfg.out)) == (2, ckpts / "step_000002")


def _from_step_2(cfg, tmp_path):
    """A copy of the killed run, resumed: from its step-2 checkpoint."""
    shutil.copytree(cfg.out, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000003.tmp")
    return cfg.replace(out=str(tmp_path / "run"), resume="must")


@pytest.mark.parametrize("plan", ["dp=2,tp=2", "auto"])
def test_resume_on_two_processes_continues_the_losses(four_process_run, tmp_path, capfd, plan):
    cfg, full = four_process_run
    resumed = run_ranks(2, _losses, _from_step_2(cfg, tmp_path).replace(plan=plan))[0]
    assert len(resumed) == 1 and abs(resumed[0] - full[2]) < 1e-4, (resumed, full)
    err = capfd.readouterr().err  # the ranks are forked processes: their stderr, not sys.stderr
    assert "resuming with world_size=2 (the checkpoint was written with 4)" in err, err
    if plan != "auto":
        # dp follows (dp=1, the default, is not written); 2 micro-batches of 4 sequences, as on dp=2
        assert "resuming with plan='tp=2,microbatches=2'" in err, err


def test_plan_that_cannot_follow_names_one_that_does(four_process_run, tmp_path, capsys):
    cfg, _ = four_process_run
    resumed = _from_step_2(cfg, tmp_path)
    line = assert_cli_error(
        ["train", "--model", "tiny", "--data", ONE_FILE_CORPUS, "--steps", "3", "--global-batch", "12", "--seq-len", "32", "--device", "cpu",
         "--plan", "dp=2,tp=2", "--nproc", "3", "--resume", "--out", resumed.out, "--no-progress", "--no-plot"],
        capsys, "--plan dp=2,tp=2 cannot follow the world size to 3 processes", "does not divide 3",
        "a plan that fits: --plan", one_line=False, ignore=("phalanx: warning",))
    assert "dp=3" in line, line


def test_micro_batches_keep_their_size():
    # 16 sequences: dp=4 x 2 micro-batches of 2; on dp=2 each rank has 8, so 4 micro-batches of 2.
    assert dp_follows(Plan(dp=4, tp=2, microbatches=2), 4, 16) == Plan(dp=2, tp=2, microbatches=4)
    assert dp_follows(Plan(dp=2, pp=2, schedule="gpipe"), 2, 8) == Plan(dp=1, pp=2, schedule="gpipe", microbatches=8)


@pytest.mark.parametrize("flags, said", [
    (["--nnodes", "2:1"], "nnodes='2:1' must be N or MIN:MAX with 1 <= MIN <= MAX"),
    (["--nnodes", "1:2"], "--nnodes 1:2 needs --rdzv-endpoint HOST:PORT"),
    (["--collective-timeout", "0"], "collective_timeout=0.0 must be a positive number of seconds"),
    (["--collective-timeout", "nan"], "collective_timeout=nan must be a positive number of seconds"),
])
def test_bad_nnodes_and_collective_timeout(tmp_path, capsys, flags, said):
    assert_cli_error(["train", "--model", "tiny", "--device", "cpu", "--nproc", "2", "--out", str(tmp_path / "r"), *flags],
                     capsys, said)
