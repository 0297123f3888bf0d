"""The run worked out once (`phalanx.train.job`): the plan parsed once, the resume decision, and
the same job on every rank when rank 0 works it out (`resume_point.agreed_job`)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from phalanx.errors import UserError
from phalanx.plan import Plan
from phalanx.testing.fork_ranks import run_ranks
from phalanx.train.job import SavedCheckpoint, resolve_job


def test_job_module_imports_no_torch():
    code = "import sys, phalanx.train.job, phalanx.train.world_change; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resolving_a_job_imports_neither_parallel_nor_torch():
    """The plan's checks against the model (tp, pp, ep, compile, float8, batch, precision) are
    torch-free (phalanx/plan_model_checks.py): working out a tp=2,pp=2 job imports no parallel/."""
    code = ("import sys; from phalanx.train.config import TrainConfig; from phalanx.train.job import resolve_job; "
            "job = resolve_job(TrainConfig(model='tiny', data='x', global_batch=8, seq_len=32, plan='tp=2,pp=2', "
            "device='cpu'), 4, None, run_dir='r'); assert job.plan.tp == 2 and job.plan.pp == 2; "
            "loaded = [m for m in sys.modules if m == 'torch' or m.startswith('phalanx.parallel')]; assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_fresh_job_holds_the_parsed_plan_and_its_micro_batches(tiny_config):
    """No plan on 4 processes: dp=4, precision filled in from --dtype, the settings' plan left
    empty (what the checkpoint records), micro-batches of global_batch / dp / microbatches."""
    job = resolve_job(tiny_config.replace(global_batch=16), 4, None, run_dir="r")
    assert job.plan == Plan(dp=4, param_dtype="fp32", reduce_dtype="fp32") and job.plan_text == "dp=4"
    assert job.settings.plan == "" and job.resume_from is None and job.start_step == 0 and job.expert_slots == 0
    assert (job.microbatches, job.microbatch_size) == (1, 4)
    assert pickle.loads(pickle.dumps(job)) == job  # what the launcher sends its workers


def test_a_resume_on_another_world_size_follows_it_and_says_so(tiny_config):
    """A checkpoint written by dp=2,tp=2 on 4 processes, resumed on 2: tp is kept, dp and the
    micro-batches follow, and the lines a resume prints name old and new."""
    saved = tiny_config.replace(plan="dp=2,tp=2", global_batch=8)
    from dataclasses import asdict

    from phalanx.model.by_name import model_config

    meta = {"step": 2, "world_size": 4, "model": model_config("tiny").to_dict(), "train": asdict(saved)}
    said = []
    job = resolve_job(saved.replace(resume="must"), 2, SavedCheckpoint(2, "r/checkpoints/step_000002", meta),
                      run_dir="r", log=said.append)
    assert job.plan.replace(param_dtype="", reduce_dtype="") == Plan(tp=2, microbatches=2)
    assert job.settings.plan == "tp=2,microbatches=2" and job.start_step == 2 and job.microbatch_size == 4
    assert said == ["phalanx: resuming with plan='tp=2,microbatches=2' (the checkpoint was written with 'dp=2,tp=2')",
                    "phalanx: resuming with world_size=2 (the checkpoint was written with 4)"]


def test_resume_must_without_a_checkpoint_is_refused(tiny_config):
    with pytest.raises(UserError, match=r"^--resume: no checkpoint found under r/checkpoints "):
        resolve_job(tiny_config.replace(resume="must"), 1, None, run_dir="r")


def _agreed(cfg):
    from pathlib import Path

    from phalanx.train.resume_point import agreed_job

    try:
        return agreed_job(cfg, Path(cfg.out))
    except UserError as error:
        return f"UserError: {error}"


def test_rank_0_works_the_job_out_and_every_rank_gets_it(tiny_config):
    """Two ranks given settings: both hold rank 0's job (plan auto decided once); a plan the
    world cannot run is the same one-line error on both."""
    jobs = run_ranks(2, _agreed, tiny_config.replace(plan="auto"))
    assert jobs[0] == jobs[1] and jobs[0].world_size == 2 and jobs[0].settings.plan not in ("", "auto")
    errors = run_ranks(2, _agreed, tiny_config.replace(plan="dp=3"))
    assert errors[0] == errors[1] and errors[0].startswith("UserError: invalid plan: dp=3 x tp=1 x pp=1 = 3"), errors


def test_which_jobs_re_split_their_pipeline(tiny_config):
    """A pipeline of one stage per rank adapts its split (`Job.adapt_split`); --no-adapt, pp=1
    and an interleaved schedule (a line says why) keep it."""
    lines: list[str] = []
    job = resolve_job(tiny_config.replace(plan="pp=2"), 2, None, run_dir="r", log=lines.append)
    assert job.adapt_split is not None and job.adapt is None and not lines
    assert resolve_job(tiny_config.replace(plan="pp=2", adapt=False), 2, None, run_dir="r").adapt_split is None
    assert resolve_job(tiny_config.replace(plan="dp=2"), 2, None, run_dir="r").adapt_split is None
    job = resolve_job(tiny_config.replace(plan="pp=2,schedule=interleaved,virtual=2"), 2, None, run_dir="r",
                      log=lines.append)
    assert job.adapt_split is None
    assert lines[-1] == ("phalanx: the pipeline's split stays as planned (not adapted to the stages' speeds): "
                         "schedule=interleaved: a rank holds several stages, whose times are not measured apart yet")


def test_a_resume_starts_from_the_split_the_run_adapted_to(tiny_config):
    """A checkpoint written after a re-split records `stage_split`; a resume with adaptation
    starts from it (and says so), one with --no-adapt or another number of stages from the
    plan's own split."""
    from dataclasses import asdict

    from phalanx.model.by_name import model_config

    cfg = tiny_config.replace(plan="pp=2", resume="must")
    meta = {"step": 4, "world_size": 2, "model": model_config("tiny").to_dict(), "train": asdict(cfg), "stage_split": "3:1"}
    saved = SavedCheckpoint(4, "r/checkpoints/step_000004", meta)
    said: list[str] = []
    assert resolve_job(cfg, 2, saved, run_dir="r", log=said.append).plan.split == "3:1"
    assert said == ["phalanx: resuming with the pipeline split 3:1 the run had adapted to (layers per stage)"]
    assert resolve_job(cfg.replace(adapt=False), 2, saved, run_dir="r").plan.split == ""
    four = dict(meta, stage_split="1:1:1:1")
    assert resolve_job(cfg, 2, SavedCheckpoint(4, "r/checkpoints/step_000004", four), run_dir="r").plan.split == ""
