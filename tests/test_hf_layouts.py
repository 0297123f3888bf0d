"""Training starts from a Hugging Face checkpoint in every layout, each rank reading its slices.

The first step's loss is computed from the loaded weights before any update, so it equals
one process's (and `transformers`' own loss on the same batch) only if every rank read the
right rows: a tp shard from the wrong columns, a pipeline stage's layers, an ep rank's
experts or an FSDP shard off by a row all move it by O(0.1). Tolerance 1e-4 as in
tests/test_hybrid_layouts.py (the reduction order differs across layouts, ~1e-6). The
second step's loss and the gradient norm of the first step are compared too, so the loaded
weights also train alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx.data.batches import rank_batch
from phalanx.data.corpus import load_corpus
from phalanx.testing.fork_ranks import run_ranks
from phalanx.train.config import TrainConfig
from phalanx.train.loop import train
from tests.hf_models import write_checkpoint

pytest.importorskip("transformers")
TOLERANCE = 1e-4
LAYOUTS = {"llama": ["tp=2", "pp=2", "dp=2,fsdp=true"], "mixtral": ["dp=2,ep=2", "tp=2"]}


def _train(cfg: TrainConfig, plans: list[str]) -> dict:
    out = {}
    for plan in plans:
        run = Path(cfg.out) / (plan.replace(",", "_").replace("=", "-") or "one")
        result = train(cfg.replace(plan=plan, out=str(run)), run)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] if run.exists() else []
        out[plan] = (result.losses, [r["grad_norm"] for r in records])
    return out


def _hf_first_loss(folder: Path, cfg: TrainConfig) -> float:
    import transformers

    inputs, targets = rank_batch(load_corpus(cfg.data).train, seed=cfg.seed, step=0, global_batch=cfg.global_batch,
                                 seq_len=cfg.seq_len, dp_rank=0, dp_size=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_layouts_start_from_the_checkpoint(tmp_path, family):
    folder = write_checkpoint(tmp_path / "hf", family, vocab_size=256, num_hidden_layers=2)
    data = tmp_path / "text.txt"
    data.write_bytes(bytes(range(256)) * 40)
    cfg = TrainConfig(model=str(folder), data=str(data), steps=2, global_batch=4, seq_len=32, lr=1e-3, warmup_steps=1,
                      eval_every=0, ckpt_every=0, sample_tokens=0, progress=False, plot=False, device="cpu", out=str(tmp_path / "runs"))
    (ref_losses, ref_norms), = run_ranks(1, _train, cfg, [""])[0].values()
    assert abs(ref_losses[0] - _hf_first_loss(folder, cfg)) < TOLERANCE
    for rank_results in run_ranks(2, _train, cfg, LAYOUTS[family], timeout_s=300):
        for plan, (losses, norms) in rank_results.items():
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOLERANCE, (plan, losses, ref_losses)
            if norms:  # rank 0 wrote the metrics
                assert abs(norms[0] - ref_norms[0]) < TOLERANCE * ref_norms[0], (plan, norms, ref_norms)


def test_random_init_ignores_the_checkpoint(tmp_path):
    folder = write_checkpoint(tmp_path / "hf", "llama", vocab_size=256, num_hidden_layers=2)
    from phalanx.hf.weights import initial_weights
    from phalanx.model.by_name import model_config

    cfg = model_config(str(folder))
    assert initial_weights(str(folder), "random", cfg) is None
    assert initial_weights(str(folder), "auto", cfg).folder == folder
