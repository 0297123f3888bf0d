"""DeepSeek-V3 trains from a transformers checkpoint in every layout, equal to one process.

The first step's loss is computed from the loaded weights before any update, so it equals
`transformers`' own loss on the same batch only if the latent projections, the router's
score-correction bias and every expert were read right. Then tp=2 (heads split, the latent
down-projections replicated with the rotated key's gradient summed, parallel/latent_tp.py),
dp=2,ep=2 and dp=4,ep=4 (the shared expert on every rank), pp=2, dp=2,zero=3 and ep with
rebalanced expert slots are compared with one process over 3 steps: losses, every weight and buffer (the routing bias moves
by router_bias_rate from the step's global expert counts) and the gradient norm, 1e-4 as in
tests/moe_runs.py (the layouts sum the same fp32 terms in another order, ~1e-7 relative per
op; a wrong shard, a missing gradient sum over tp or ep moves them by far more).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.data.batches import rank_batch
from phalanx.data.corpus import load_corpus
from phalanx.testing.fork_ranks import run_ranks
from phalanx.train.config import TrainConfig
from tests.deepseek_models import YARN, write_deepseek
from tests.moe_runs import TOLERANCE, compare, run_and_gather

pytest.importorskip("transformers")
LAYOUTS = [("tp=2", 0), ("dp=2,ep=2", 0), ("pp=2", 0), ("dp=2,zero=3", 0), ("dp=2,ep=2", 10)]
"""(plan, expert slots): 10 slots for 8 experts puts two replicas on the ep ranks, rebalanced
after every step (the replicas follow the measured load)."""


def _runs(cfg: TrainConfig, layouts) -> dict:
    out = {}
    for plan, slots in layouts:
        run = Path(cfg.out) / f"{plan.replace(',', '_').replace('=', '-') or 'one'}-{slots}"
        out[plan, slots] = run_and_gather(cfg.replace(plan=plan, expert_slots=slots, rebalance_every=1 if slots else 0,
                                                      out=str(run)))
    return out


def _hf_first_loss(folder: Path, cfg: TrainConfig) -> float:
    import transformers

    inputs, targets = rank_batch(load_corpus(cfg.data).train, seed=cfg.seed, step=0, global_batch=cfg.global_batch,
                                 seq_len=cfg.seq_len, dp_rank=0, dp_size=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def _setup(tmp_path) -> tuple[Path, TrainConfig]:
    folder = write_deepseek(tmp_path / "hf", vocab_size=256, num_hidden_layers=2, n_group=2, topk_group=1,
                            rope_parameters=YARN)
    data = tmp_path / "text.txt"
    data.write_bytes(bytes(range(256)) * 40)
    cfg = TrainConfig(model=str(folder), data=str(data), steps=3, global_batch=4, seq_len=32, lr=1e-3, warmup_steps=1,
                      eval_every=0, ckpt_every=0, sample_tokens=0, progress=False, plot=False, device="cpu", out=str(tmp_path / "runs"))
    return folder, cfg


def test_layouts_equal_one_process_and_transformers(tmp_path):
    folder, cfg = _setup(tmp_path)
    reference = run_ranks(1, _runs, cfg, [("", 0)])[0]["", 0]
    assert abs(reference[0][0] - _hf_first_loss(folder, cfg)) < TOLERANCE
    results = run_ranks(2, _runs, cfg, LAYOUTS, timeout_s=900)
    for layout in LAYOUTS:
        compare([rank_results[layout] for rank_results in results], reference)


def test_dp4_ep4_equals_one_process(tmp_path):
    """The issue's dp=4,ep=4: two experts per rank, each token's two experts on up to two of
    the four ranks (one group of four experts per token: topk_group=1 of n_group=2)."""
    _, cfg = _setup(tmp_path)
    reference = run_ranks(1, _runs, cfg, [("", 0)])[0]["", 0]
    results = run_ranks(4, _runs, cfg, [("dp=4,ep=4", 0)], timeout_s=900)
    compare([rank_results["dp=4,ep=4", 0] for rank_results in results], reference)
