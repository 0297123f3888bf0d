import os

import pytest

from phalanx.process_count import usable_cores
from phalanx.testing.small_corpus import ONE_FILE_CORPUS


def _share_cores_among_xdist_workers() -> None:
    """Under `pytest -n N`, each worker gets its share of the cores for torch's intra-op
    threads, and so do the processes it starts (OMP_NUM_THREADS is inherited). Two workers of
    two threads each on two cores oversubscribe them, and OpenMP's spin-waiting threads then
    burn CPU doing nothing: test_deepseek_models.py + test_serve_engine.py took 29.1 s of user
    CPU with two threads and 18.8 s with one, at the same wall time (-p no:cacheprovider, this
    2-core machine, other work running)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        threads = max(1, usable_cores() // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_cores_among_xdist_workers()


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
        ckpt_every=0, sample_tokens=0, progress=False, plot=False, device="cpu", out=str(tmp_path / "run"),
    )


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory):
    """The expert-parallel tests' run (tiny-moe, 3 steps); one per test module."""
    from phalanx.train.config import TrainConfig
    from tests.moe_runs import STEPS

    out = tmp_path_factory.mktemp("moe")
    return TrainConfig(
        model="tiny-moe", steps=STEPS, global_batch=8, seq_len=32, lr=3e-3, warmup_steps=1, eval_every=0,
        ckpt_every=0, sample_tokens=0, progress=False, plot=False, device="cpu", out=str(out / "run"),
    )


@pytest.fixture(scope="module")
def moe_reference(moe_config):
    """One process of `moe_config`: losses, full weights, gradient norms."""
    from phalanx.testing.fork_ranks import run_ranks
    from tests.moe_runs import run_and_gather

    return run_ranks(1, run_and_gather, moe_config.replace(out=moe_config.out + "-ref"))[0]




@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that talked to a real `phalanx serve` shows that server's log: a 500 seen by
    the client says nothing of its cause, which only the server printed (a flake in CI cannot
    be rerun to look)."""
    report = yield
    if report.failed:
        from tests.serve_server import ServeProcess

        for name, value in getattr(item, "funcargs", {}).items():
            if isinstance(value, ServeProcess):
                report.sections.append((f"stderr of the server `{name}` (its last 6000 characters)",
                                        "".join(value.stderr)[-6000:]))
    return report
