"""Data-parallel shares adapted to the ranks' speeds compute what one process computes.

Two gloo ranks train the tiny model for 6 steps while the shares of the global batch (8
sequences) change twice: speeds [5, 3] are injected for steps 1-2 and [3, 5] after (the
`speeds` argument of `train`, in place of the measured ones), with a decision window of 2
steps, so steps 1-2 run with shares [4, 4], steps 3-4 with [5, 3] and steps 5-6 with [3, 5].
With microbatches=2 the shares split unevenly inside a rank too ([3, 2] and [2, 1]).

Each rank weights its micro-batches' mean losses by their fraction of the global batch times
the number of ranks, so DDP's average of the ranks' gradients is the global batch's mean
gradient whatever the shares: losses, gradient norms (clipping is active: norms ~3-4 > 1, so
a wrongly weighted gradient moves every weight) and every rank's final weights must equal one
process within 1e-4, tests/test_data_parallel.py's bound (only summation order differs:
measured differences are ~1e-6). Weighting by the local mean instead (1 / microbatches) was
tried: the loss moved by 8e-3 at the first step after the change and 2.5e-2 by step 6.

`--no-adapt` (adapt=False) keeps equal shares under the same injected speeds. Every step row
carries both ranks' compute and wait seconds.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from phalanx.adapt_policy import AdaptRules
from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.weights import gathered_weights

TOLERANCE = 1e-4

RUNS = [("dp=2", True), ("dp=2,microbatches=2", True), ("dp=2", False)]  # (plan, adapt)


def _speeds(step: int) -> list[float]:
    return [5.0, 3.0] if step <= 2 else [3.0, 5.0]


def _dir(plan: str, adapt: bool) -> str:
    return f"{plan.replace(',', '_').replace('=', '-') or 'one'}-{'adapt' if adapt else 'no-adapt'}"


def _train_all(cfg, runs) -> dict:
    from phalanx.train.loop import train
    from phalanx.train.resume_point import agreed_job

    out = {}
    for plan, adapt in runs:
        run_dir = Path(cfg.out) / _dir(plan, adapt)
        job = agreed_job(cfg.replace(plan=plan, adapt=adapt, out=str(run_dir)), run_dir)
        if job.adapt:
            job = dataclasses.replace(job, adapt=AdaptRules(window=2))
        result = train(job, run_dir, speeds=_speeds)
        out[plan, adapt] = (result.losses, gathered_weights(result.model))
    return out


def _rows(cfg, plan: str, adapt: bool) -> list[dict]:
    lines = (Path(cfg.out) / _dir(plan, adapt) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_changing_shares_match_one_process(tiny_config):
    cfg = tiny_config.replace(steps=6)
    ref_losses, ref_weights = run_ranks(1, _train_all, cfg, [("", False)])[0]["", False]
    ref_norms = [row["grad_norm"] for row in _rows(cfg, "", False)]
    results = run_ranks(2, _train_all, cfg, RUNS, timeout_s=300)
    for plan, adapt in RUNS:
        for rank_results in results:  # every rank's copy, not one
            losses, weights = rank_results[plan, adapt]
            assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOLERANCE, (plan, losses, ref_losses)
            for name, value in weights.items():
                torch.testing.assert_close(value, ref_weights[name], atol=TOLERANCE, rtol=TOLERANCE, msg=name)
        rows = _rows(cfg, plan, adapt)
        steps = [row for row in rows if "loss" in row]
        for norm, ref in zip([row["grad_norm"] for row in steps], ref_norms, strict=True):
            assert abs(norm - ref) < TOLERANCE * ref, (plan, norm, ref)
        for row in steps:
            assert len(row["compute_s_by_rank"]) == len(row["wait_s_by_rank"]) == 2
            assert all(c > 0 for c in row["compute_s_by_rank"]) and all(w >= 0 for w in row["wait_s_by_rank"])
        changes = [(row["step"], row["shares"]) for row in rows if row.get("event") == "adapt"]
        assert changes == ([(2, [5, 3]), (4, [3, 5])] if adapt else []), (plan, changes)


def test_a_persistently_slow_rank_is_named_in_an_event_row():
    """The step's agreed compute seconds (step_sync.py) reach the straggler watch
    (train_step.adapt_events, whose rows the step writes to metrics.jsonl): rank 1 at twice
    its peer's time for `straggler_steps` steps in a row is named once."""
    from phalanx.adapt_policy import StragglerWatch
    from phalanx.train.step_sync import StepAgreement
    from phalanx.train.train_step import adapt_events

    watch = StragglerWatch(AdaptRules(straggler_steps=2))
    slow = StepAgreement(loss=1.0, stop=0, peak_mb_by_rank=[1.0, 1.0], compute_s_by_rank=[0.2, 0.4],
                         wait_s_by_rank=[0.2, 0.0])
    assert adapt_events(1, slow, None, watch, None) == []
    assert adapt_events(2, slow, None, watch, None) == [
        {"event": "straggler", "step": 2, "rank": 1, "compute_s": 0.4, "median_s": 0.2}]
    assert adapt_events(3, slow, None, watch, None) == []  # named once per slow spell
