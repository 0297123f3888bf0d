"""The TensorBoard event file beside metrics.jsonl holds the same numbers, step by step.

The event file is read back with TensorBoard's own loader (EventAccumulator). TensorBoard
stores a scalar as a 32-bit float, so each value must equal metrics.jsonl's value rounded to
float32, exactly: the writer does no arithmetic of its own but a `max` over ranks.

Rows without `loss` (event rows, such as a restart) are not steps: the writer and every other
reader of metrics.jsonl pass over them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from phalanx.testing.fork_ranks import run_ranks
from phalanx.train.loop import train
from phalanx.train.metrics import MetricsLog, plot_loss, read_metrics
from phalanx.train.expert_load_plot import plot_expert_load


def _train(cfg) -> None:
    train(cfg, Path(cfg.out))


def _event_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0}).Reload()  # 0: keep every event
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _f32(value: float) -> float:
    return float(np.float32(value))


def _expected(rows, key, reduce=lambda value: value):
    """(step, value as float32) for each row whose `key` is there and not null."""
    return [(row["step"], _f32(reduce(row[key]))) for row in rows if row.get(key) is not None]


def test_event_file_equals_metrics_jsonl(tiny_config):
    cfg = tiny_config.replace(steps=4, eval_every=2)
    run_ranks(1, _train, cfg)
    rows = read_metrics(Path(cfg.out) / "metrics.jsonl")
    got = _event_scalars(Path(cfg.out))
    expected = {
        "train/loss": _expected(rows, "loss"), "train/lr": _expected(rows, "lr"),
        "train/grad_norm": _expected(rows, "grad_norm"), "train/val_loss": _expected(rows, "val_loss"),
        "speed/tokens_per_s": _expected(rows, "tokens_per_s"), "speed/step_time_s": _expected(rows, "step_time_s"),
        "memory/peak_mem_mb": _expected(rows, "peak_mem_mb"),
        "memory/peak_mem_mb_max_rank": _expected(rows, "peak_mem_mb_by_rank", max),
        "ranks/compute_s/rank_0": _expected(rows, "compute_s_by_rank", lambda v: v[0]),
        "ranks/wait_s/rank_0": _expected(rows, "wait_s_by_rank", lambda v: v[0]),
    }
    assert [step for step, _ in expected["train/val_loss"]] == [2, 4]
    assert got == expected


def test_moe_imbalance_and_bubble_equal_metrics_jsonl(tiny_config):
    """tiny-moe over two pipeline stages: each rank holds half the MoE layers, and rank 0's
    record (and event file) must still have every layer, and the measured bubble."""
    cfg = tiny_config.replace(model="tiny-moe", steps=3, plan="pp=2")
    run_ranks(2, _train, cfg)
    rows = read_metrics(Path(cfg.out) / "metrics.jsonl")
    got = _event_scalars(Path(cfg.out))
    layers = list(rows[0]["moe"])
    assert len(layers) == 4
    for layer in layers:
        for field in ("expert_imbalance", "rank_imbalance", "dropped"):
            assert got[f"moe/{field}/layer_{layer}"] == [(r["step"], _f32(r["moe"][layer][field])) for r in rows]
    assert any(r["moe"][layers[0]]["expert_imbalance"] > 0 for r in rows)  # a real load, not all zeros
    for key in ("bubble", "bubble_formula"):
        assert got[f"pipeline/{key}"] == _expected(rows, key)
        assert len(got[f"pipeline/{key}"]) == 3


def _wait_for_next_second() -> None:
    """Event file names start with the whole second they were opened in, and TensorBoard reads
    a run's files in name order: a resumed run's file must sort after the first one, as it
    always does outside a test that resumes within the same second."""
    time.sleep(1 - time.time() % 1 + 0.01)


def test_resume_shows_each_step_once(tmp_path):
    """A run logs steps 1-4, then resumes from its step-2 checkpoint and logs steps 3-4 again
    with other values: TensorBoard must show steps 1-4 once, the redone ones as resumed, as
    metrics.jsonl does. (The loop opens MetricsLog with the checkpoint's step: test_resume.py.)"""
    metrics = tmp_path / "metrics.jsonl"
    first = MetricsLog(metrics)
    for step in (1, 2, 3, 4):
        first.write({"step": step, "loss": 10.0 - step})
    first.close()
    _wait_for_next_second()
    resumed = MetricsLog(metrics, resume_step=2)
    for step in (3, 4):
        resumed.write({"step": step, "loss": 20.0 - step})
    resumed.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert [r["loss"] for r in read_metrics(metrics)] == [9.0, 8.0, 17.0, 16.0]
    assert _event_scalars(tmp_path)["train/loss"] == [(1, 9.0), (2, 8.0), (3, 17.0), (4, 16.0)]


def _step_row(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1, "tokens_per_s": 10.0,
            "peak_mem_mb": 5.0, "moe": {"1": {"expert_tokens": [3, 1], "rank_tokens": [4], "expert_imbalance": 0.5,
                                              "rank_imbalance": 0.0, "dropped": 0}}}


def test_readers_skip_event_rows(tmp_path):
    """Rows without `loss` (a restart event) are not steps: readers and plots pass over them."""
    from phalanx.train.tensorboard_log import scalars

    steps = [_step_row(1, 2.5), _step_row(2, 2.25), _step_row(3, 2.0)]
    event = {"event": "restart", "step": 2}
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in [steps[0], steps[1], event, steps[2]]))
    assert read_metrics(metrics) == steps
    plot_loss(metrics, tmp_path / "loss.png")
    assert plot_expert_load(metrics, tmp_path / "experts.png")
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "experts.png").stat().st_size > 0
    assert scalars(event) == {}
    assert scalars(steps[0])["moe/expert_imbalance/layer_1"] == 0.5


@pytest.mark.parametrize("bubble", [None, 0.25])
def test_unmeasured_bubble_is_left_out(bubble):
    """A pipeline step whose bubble could not be measured records `bubble: null`: no scalar."""
    from phalanx.train.tensorboard_log import scalars

    got = scalars({"step": 1, "loss": 1.0, "bubble": bubble, "bubble_formula": 0.5})
    assert got.get("pipeline/bubble") == bubble and got["pipeline/bubble_formula"] == 0.5
