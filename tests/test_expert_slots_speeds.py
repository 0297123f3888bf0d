"""Expert slots placed by the ranks' speeds as well as the experts' loads train one process's model.

dp=2,ep=2 with --rebalance-every 2 on a skewed router (tests/test_expert_slots_training.py's
bias: with top-2 routing every token here goes to experts 0 and 1, 256 rows each per step per
MoE layer), 4 steps, one slot per expert (experts 0-3 start on rank 0, which computes every
row). The ranks' speeds are injected (`train`'s `speeds`: rank 1 three times as fast as rank
0, in place of the measured ones), with a window of 2 steps. At step 2 the placement evens load / speed: both hot experts
on rank 1 (time 512 / 1) beat one on each rank (256 / (1/3) = 768 on rank 0), so from step
3 rank 1 computes every row. Under `--no-adapt` the balancer evens the loads alone: one hot
expert on each rank, 256 rows each.

Moving slots copies weights and AdamW moments; routing still sends each token to the same
experts with the same weights, so losses, gradient norms and every weight equal one process
within 1e-4: tests/test_expert_slots_training.py's tolerance argument (summation order only).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from phalanx.adapt_policy import AdaptRules
from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.weights import gathered_weights

TOLERANCE = 1e-4
SKEW = (0.3, 0.2, 0.1, 0.05, 0.0, 0.0, 0.0, 0.0)


def _skew_routers(monkeypatch):
    from phalanx.model.router import Router

    def skewed_reset(self):
        self.expert_bias.copy_(torch.tensor(SKEW[: self.expert_bias.numel()]))

    monkeypatch.setattr(Router, "reset_buffers", skewed_reset)  # forked ranks inherit it


def _speeds(step: int) -> list[float]:
    return [1.0, 3.0]


def _run(cfg):
    from phalanx.train.loop import train
    from phalanx.train.resume_point import agreed_job

    job = agreed_job(cfg, Path(cfg.out))
    if job.adapt_experts is not None:  # a window of 2 steps: the speeds weigh the step-2 placement
        job = dataclasses.replace(job, adapt_experts=AdaptRules(window=2))
    result = train(job, Path(cfg.out), speeds=_speeds)
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    return result.losses, gathered_weights(result.model), rows


def _rank_rows(row: dict) -> list[float]:
    """Expert rows each rank computed in a step, over the MoE layers."""
    return [sum(layer["rank_tokens"][r] for layer in row["moe"].values()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(moe_config):
    cfg = moe_config.replace(steps=4, rebalance_every=2)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _skew_routers(monkeypatch)
        reference = run_ranks(1, _run, cfg.replace(rebalance_every=0, out=cfg.out + "-speeds-ref"))[0]
        adapted = run_ranks(2, _run, cfg.replace(plan="dp=2,ep=2", out=cfg.out + "-speeds"))
        equal = run_ranks(2, _run, cfg.replace(plan="dp=2,ep=2", adapt=False, out=cfg.out + "-speeds-no-adapt"))
    return reference, adapted, equal


def test_slots_weighted_by_speed_match_one_process(runs):
    reference, adapted, _ = runs
    ref_losses, ref_weights, ref_rows = reference
    ref_norms = [r["grad_norm"] for r in ref_rows if "grad_norm" in r]
    norms = [r["grad_norm"] for r in adapted[0][2] if "grad_norm" in r]
    torch.testing.assert_close(norms, ref_norms, rtol=TOLERANCE, atol=0)
    for losses, weights, _ in adapted:
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOLERANCE, (losses, ref_losses)
        assert weights.keys() == ref_weights.keys()
        for name, value in weights.items():
            torch.testing.assert_close(value, ref_weights[name], atol=TOLERANCE, rtol=TOLERANCE, msg=name)


def test_the_faster_rank_takes_the_hot_experts(runs):
    _, adapted, equal = runs
    events = [r for r in adapted[0][2] if r.get("event") == "rebalance"]
    assert events[0]["step"] == 2 and events[0]["speeds"] == [0.3333, 1.0] and events[0]["moved_slots"] > 0, events
    steps = [r for r in adapted[0][2] if "loss" in r]
    before, after = _rank_rows(steps[1]), _rank_rows(steps[3])
    assert before[1] == 0 and after[0] == 0 and after[1] == before[0] > 0, (before, after)
    plain = [r for r in equal[0][2] if r.get("event") == "rebalance"]
    assert plain and all("speeds" not in r for r in plain)  # --no-adapt: loads alone
    unweighted = _rank_rows([r for r in equal[0][2] if "loss" in r][3])
    assert unweighted[0] == unweighted[1] > 0, unweighted
