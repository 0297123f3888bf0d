"""What the expert-parallel tests share: one run's losses, full weights and gradient norms,
and the comparisons with the one-process reference (tolerances in tests/test_expert_parallel.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from phalanx.testing.weights import gathered_weights
from phalanx.train.loop import train

TOLERANCE = 1e-4
STEPS = 3


def run_and_gather(cfg):
    import torch.distributed as dist

    result = train(cfg, Path(cfg.out))
    weights = gathered_weights(result.model)
    if dist.get_rank() != 0:
        return result.losses, weights, None
    records = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    return result.losses, weights, [r["grad_norm"] for r in records if "grad_norm" in r]  # not the rebalance records


def compare(results, reference):
    ref_losses, ref_weights, ref_norms = reference
    # The clipping norm must cover every rank's experts: AdamW hides a wrong clip factor in
    # the weights (it is nearly scale-invariant), so compare the norm itself.
    torch.testing.assert_close(results[0][2], ref_norms, rtol=TOLERANCE, atol=0)
    seen = set()
    for losses, weights, _ in results:
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOLERANCE, (losses, ref_losses)
        for name, value in weights.items():
            torch.testing.assert_close(value, ref_weights[name], atol=TOLERANCE, rtol=TOLERANCE, msg=name)
        seen |= weights.keys()
    assert seen == ref_weights.keys()  # a pipeline stage holds some layers; together, all of them


def check_load_records(cfg, dp: int) -> None:
    """metrics.jsonl carries per-layer counts that add up (every token visits k experts in
    every MoE layer, and is computed by exactly one rank), and the heat-map is written."""
    records = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == cfg.steps
    assignments = cfg.global_batch * cfg.seq_len * 2  # top-2
    for record in records:
        assert set(record["moe"]) == {"0", "1", "2", "3"}
        for layer in record["moe"].values():
            assert sum(layer["expert_tokens"]) == assignments
            assert sum(layer["rank_tokens"]) == assignments and len(layer["rank_tokens"]) == dp
            assert layer["dropped"] == 0 and layer["expert_imbalance"] >= 0
    assert (Path(cfg.out) / "experts.png").exists() == cfg.plot  # the heat-map, unless --no-plot


def expert_counts(out: str) -> list[dict[str, list[int]]]:
    """Per step, each MoE layer's tokens per expert, from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{layer: value["expert_tokens"] for layer, value in r["moe"].items()} for r in records]
