"""Plans that cannot run this model are one-line errors in the parent, before any worker."""

from __future__ import annotations

import pytest

from phalanx.train import launch
from phalanx.errors import UserError
from phalanx.train.config import TrainConfig


@pytest.fixture
def no_workers(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started for an invalid plan")

    monkeypatch.setattr(launch, "launch_with_restarts", refuse)
    monkeypatch.setattr(launch, "worker_main", refuse)


@pytest.mark.parametrize("nproc, plan, extra, message", [
    (3, "tp=3", {}, "tp=3 must divide n_heads=4 of model 'tiny'"),
    (4, "tp=4", {}, "tp=4 must divide n_kv_heads=2"),
    (2, "tp=2,sp=true", {"seq_len": 33}, "sp=true splits the sequence over tp=2, which must divide seq_len=33"),
    (8, "pp=8", {}, "pp=8 x virtual=1 = 8 stages, but model 'tiny' has 4 layers"),
    (4, "pp=4,schedule=interleaved,virtual=2", {}, "= 8 stages, but model 'tiny' has 4 layers"),
    (2, "pp=2,schedule=dualpipev,virtual=2,microbatches=2", {}, "needs microbatches >= 4, got 2"),
    (2, "pp=2,microbatches=1", {}, "needs microbatches >= 2, got 1"),
    (2, "pp=2,schedule=interleaved,virtual=2,microbatches=5", {"global_batch": 10}, "in 2 rounds"),
    (2, "pp=2,split=3:2", {}, "split=3:2 adds up to 5 layers, but the model has 4"),
    (2, "pp=2,split=4", {}, "split=4 gives 1 stages, but pp x virtual = 2"),
    (2, "tp=2,split=2:2", {}, "split=2:2 divides layers between pipeline stages, but pp=1"),
    (2, "sp=true,dp=2", {}, "sp=true needs tp > 1"),
    (4, "dp=2,pp=2,microbatches=3", {}, "global_batch=8 must divide evenly into dp=2 ranks x microbatches=3"),
    (4, "dp=2,tp=2", {"nproc": 8}, "dp=2 x tp=2 x pp=1 = 4, but 8 processes were started"),
    (4, "pp=2,schedule=zbv,virtual=1", {"nproc": 2}, "schedule=zbv uses exactly virtual=2"),
])
def test_invalid_plan_fails_before_launch(tmp_path, no_workers, nproc, plan, extra, message):
    cfg = TrainConfig(model="tiny", global_batch=8, seq_len=32, device="cpu", out=str(tmp_path / "run"),
                      nproc=nproc, plan=plan).replace(**extra)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        launch.launch_train(cfg)


def test_multi_chunk_schedules_default_to_two_chunks_in_plan_strings():
    """The issue's example names no `virtual`; the string grammar fills in 2 and round-trips."""
    from phalanx.plan import plan_from_string

    plan = plan_from_string("dp=2,tp=2,pp=2,schedule=interleaved,microbatches=8", 8)
    assert plan.virtual == 2
    assert plan_from_string(plan.to_string(), 8) == plan
    assert plan_from_string("pp=2,schedule=dualpipev", 2).virtual == 2
    assert plan_from_string("pp=2,schedule=interleaved,virtual=3", 2).virtual == 3
