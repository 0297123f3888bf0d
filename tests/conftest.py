import pytest

from phalanx.testing.small_corpus import ONE_FILE_CORPUS


@pytest.fixture(scope="session", autouse=True)
def _ranks_inherit_lazy_imports():
    """Ranks forked from pytest (run_ranks, in-process `phalanx train --nproc N`) inherit what
    a training rank imports lazily instead of importing it again in every rank of every test."""
    from phalanx.testing.fork_ranks import preload_rank_imports

    preload_rank_imports()


@pytest.fixture
def tiny_config(tmp_path):
    """A TrainConfig small enough for a multi-rank test to run in seconds."""
    from phalanx.train.config import TrainConfig

    return TrainConfig(
        model="tiny", data=ONE_FILE_CORPUS, steps=4, global_batch=8, seq_len=32, lr=3e-3, warmup_steps=1, eval_every=0,
        ckpt_every=0, sample_tokens=0, progress=False, device="cpu", out=str(tmp_path / "run"),
    )


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory):
    """The expert-parallel tests' run (tiny-moe, 3 steps); one per test module."""
    from phalanx.train.config import TrainConfig
    from tests.moe_runs import STEPS

    out = tmp_path_factory.mktemp("moe")
    return TrainConfig(
        model="tiny-moe", steps=STEPS, global_batch=8, seq_len=32, lr=3e-3, warmup_steps=1, eval_every=0,
        ckpt_every=0, sample_tokens=0, progress=False, device="cpu", out=str(out / "run"),
    )


@pytest.fixture(scope="module")
def moe_reference(moe_config):
    """One process of `moe_config`: losses, full weights, gradient norms."""
    from phalanx.testing.fork_ranks import run_ranks
    from tests.moe_runs import run_and_gather

    return run_ranks(1, run_and_gather, moe_config.replace(out=moe_config.out + "-ref"))[0]
