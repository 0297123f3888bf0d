"""Readers of metrics.jsonl pass over rows that are not steps (event rows, which carry no `loss`)."""

from __future__ import annotations

import json

from phalanx.train.metrics import plot_loss, read_metrics
from phalanx.train.moe_stats import plot_expert_load


def _step_row(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1, "tokens_per_s": 10.0,
            "peak_mem_mb": 5.0, "moe": {"1": {"expert_tokens": [3, 1], "rank_tokens": [4], "expert_imbalance": 0.5,
                                              "rank_imbalance": 0.0, "dropped": 0}}}


def test_readers_skip_event_rows(tmp_path):
    """Rows without `loss` (a restart event) are not steps: readers and plots pass over them."""
    steps = [_step_row(1, 2.5), _step_row(2, 2.25), _step_row(3, 2.0)]
    event = {"event": "restart", "step": 2}
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in [steps[0], steps[1], event, steps[2]]))
    assert read_metrics(metrics) == steps
    plot_loss(metrics, tmp_path / "loss.png")
    assert plot_expert_load(metrics, tmp_path / "experts.png")
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "experts.png").stat().st_size > 0
