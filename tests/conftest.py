import pytest


@pytest.fixture
def tiny_config(tmp_path):
    """A TrainConfig small enough for a multi-rank test to run in seconds."""
    from phalanx.train.config import TrainConfig

    return TrainConfig(
        model="tiny", steps=4, global_batch=8, seq_len=32, lr=3e-3, warmup_steps=1, eval_every=0,
        ckpt_every=0, sample_tokens=0, progress=False, device="cpu", out=str(tmp_path / "run"),
    )
