"""`phalanx train --model tiny-dsv3` learns, and its routing bias keeps learning.

Bytes start at ln(256) = 5.55 nats; 12 steps on the built-in corpus (Python's stdlib) must
lower the loss by at least 10% (measured: the mean of steps 8-12 is 4.07 from 5.62, and 30
steps reach about half). A small batch (4 x 64 tokens)
keeps the test to seconds of compute. The sigmoid router's score-correction bias moves by
router_bias_rate each step (auxiliary-loss-free balancing), so after 12 steps it is not zero
in the checkpoint the run leaves; `phalanx export` turns that checkpoint into a
`deepseek_v3` directory with transformers' logits equal to the run's model.
"""

from __future__ import annotations

import json

import pytest

from phalanx.cli import main


def test_tiny_dsv3_trains(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "tiny-dsv3", "--steps", "12", "--nproc", "1", "--global-batch", "4", "--seq-len", "64",
              "--lr", "1e-2", "--eval-every", "0", "--ckpt-every", "0", "--sample-tokens", "0", "--no-progress", "--no-plot",
              "--out", str(out)])
    assert exit_info.value.code == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12 and losses[0] > 5.0
    assert sum(losses[-5:]) / 5 <= 0.9 * losses[0], losses

    from phalanx.hf.export_run import find_checkpoint, load_checkpoint_model
    from phalanx.model.config import ModelConfig

    path, meta = find_checkpoint(out, None)
    model = load_checkpoint_model(path, ModelConfig.from_dict(meta["model"]))
    for layer in ("1", "2", "3"):
        assert model.layers[layer].feed_forward.router.expert_bias.abs().max() > 0, layer

    # `phalanx export` writes the run as a deepseek_v3 directory, learned bias included, that
    # transformers computes the same logits from (1e-4, as tests/test_deepseek_models.py).
    import torch

    from phalanx.hf.export_run import export_run
    from tests.hf_models import hf_logits

    exported = export_run(out, tmp_path / "hf")
    assert json.loads((exported / "config.json").read_text())["model_type"] == "deepseek_v3"
    tokens = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(0))  # past YaRN's 64
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(exported, tokens), model(tokens), rtol=1e-4, atol=1e-4)
