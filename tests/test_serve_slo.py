"""The SLO scheduler (`--ttft-ms`, `--tpot-ms`) on a simulated clock, without a model: a step
takes what a fixed linear "device" says its shape costs (the test's ground truth, which the
scheduler never sees: it learns it online from the measured step times, starting from a prior
that is off by 4x), and every sampled token is 1."""

from __future__ import annotations

import random

import pytest

from phalanx.scheduling.scheduler import Scheduler, Sequence
from phalanx.scheduling.slo_policy import QueueShape, SloPolicy, SloTargets, SloUnattainable
from phalanx.scheduling.slo_step_time import OnlineStepFit, StepPrior, StepShape, step_shape

TRUE = (0.004, 0.0015, 0.0002, 0.000002)
"""The simulated device: seconds per step, per decode, per prefilled token, per attended key."""
TPOT_S = 0.04


def device_seconds(shape: StepShape) -> float:
    return sum(c * x for c, x in zip(TRUE, shape.features()))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _load(count: int = 60, gap_s: float = 0.03, seed: int = 0) -> list[tuple[float, Sequence]]:
    """Arrivals every `gap_s`: prompts of 64-320 tokens, outputs of 16-48."""
    rng = random.Random(seed)
    return [(i * gap_s, Sequence.of(str(i), [rng.randrange(1000) for _ in range(rng.randint(64, 320))],
                                    rng.randint(16, 48))) for i in range(count)]


def _serve(policy: SloPolicy | None, load, max_steps: int = 20000):
    """Drive a scheduler over the load as the engine loop does (admission at arrival, one
    measured step after another); returns (step times, finished, refused sequences)."""
    clock = Clock()
    scheduler = Scheduler(num_blocks=4096, block_size=16, max_num_seqs=32, max_num_batched_tokens=512,
                          max_waiting=1000, clock=clock, slo=policy)
    pending, finished, refused, step_times = list(load), [], [], []
    for _ in range(max_steps):
        while pending and pending[0][0] <= clock.now:
            arrival, seq = pending.pop(0)
            seq.arrival = arrival
            try:
                if policy is not None:
                    policy.check_admission(scheduler.queue_shape(), len(seq.prompt))
                scheduler.add(seq)
            except SloUnattainable:
                refused.append(seq)
        if not scheduler.has_work():
            if not pending:
                break
            clock.now = pending[0][0]
            continue
        step = scheduler.schedule()
        seconds = device_seconds(step_shape(step))
        clock.now += seconds
        if policy is not None:
            policy.observe(step, seconds)
        step_times.append((seconds, sum(1 for c in step.chunks if c.length == 1)))
        finished += scheduler.finish_step(step, {id(c.seq): 1 for c in step.chunks if c.samples})
    assert not pending and not scheduler.has_work()
    return step_times, finished, refused


def _tpot(seq: Sequence) -> float:
    return (seq.finished_at - seq.first_token_at) / (len(seq.output) - 1)


def test_online_fit_learns_the_step_time_from_measured_steps():
    """From a prior 4x off, 60 steps of varied shapes bring every prediction within 2% (the
    device is exactly linear, so least squares recovers it)."""
    fit = OnlineStepFit(StepPrior(*(4 * c for c in TRUE)))
    rng = random.Random(1)
    shapes = [StepShape(rng.randint(0, 32), rng.choice((0, 0, rng.randint(2, 512))), rng.randint(0, 8000))
              for _ in range(80)]
    for shape in shapes[:60]:
        fit.observe(shape, device_seconds(shape))
    for shape in shapes[60:]:
        assert fit.predict(shape) == pytest.approx(device_seconds(shape), rel=0.02)


def test_the_fit_stays_bounded_and_right_over_a_long_unvaried_run():
    """5,000 decode-only steps of one shape (nothing about prefill in them), then prefill
    steps: the uncertainty the forgetting inflates stays capped, and the fit still learns."""
    fit = OnlineStepFit(StepPrior(*TRUE))
    same = StepShape(16, 0, 4000)
    for _ in range(5000):
        fit.observe(same, device_seconds(same))
    assert all(fit.cov[i][i] <= cap * (1 + 1e-9) for i, cap in enumerate(fit._cov_cap))
    assert fit.predict(same) == pytest.approx(device_seconds(same), rel=1e-3)
    for prefill in (100, 300, 500, 200):
        shape = StepShape(16, prefill, 4000 + prefill)
        fit.observe(shape, device_seconds(shape))
    assert fit.predict(StepShape(16, 400, 4400)) == pytest.approx(device_seconds(StepShape(16, 400, 4400)), rel=0.02)


def test_unconstrained_scheduler_misses_tpot_the_slo_scheduler_keeps_it():
    """The same load both ways. Without targets, steps carry up to 512 prompt tokens beside the
    decodes and the running requests' TPOT goes above 40 ms. With --tpot-ms 40, once the fit
    has seen a few steps (the prior is 4x pessimistic, so the first steps are small), no step
    with decodes takes longer than the target, and every request meets it; all requests are
    served (no TTFT target: nothing is refused)."""
    load = _load()
    steps, finished, _ = _serve(None, load)
    assert max(_tpot(seq) for seq in finished) > TPOT_S
    assert max(seconds for seconds, decodes in steps if decodes) > TPOT_S

    load = _load()
    policy = SloPolicy(SloTargets(tpot_s=TPOT_S), 512, OnlineStepFit(StepPrior(*(4 * c for c in TRUE))))
    steps, finished, refused = _serve(policy, load)
    assert not refused and len(finished) == len(load)
    assert all(seconds <= TPOT_S for seconds, decodes in steps[10:] if decodes)
    assert max(_tpot(seq) for seq in finished) <= TPOT_S
    # As large as the target allows: the batch is not starved to one sequence at a time.
    assert max(decodes for _, decodes in steps) >= 8


def test_an_optimistic_prior_is_corrected_online():
    """A prior 10x too fast would let 512-token chunks beside the decodes (every such step
    over the target); the measured steps correct it, and from the 10th step on every step
    with decodes is within the target."""
    prior = StepPrior(*(c / 10 for c in TRUE))
    assert OnlineStepFit(prior).predict(StepShape(8, 512, 4000)) < TPOT_S * 0.85 < device_seconds(StepShape(8, 512, 4000))
    policy = SloPolicy(SloTargets(tpot_s=TPOT_S), 512, OnlineStepFit(prior))
    steps, finished, _ = _serve(policy, _load())
    assert all(seconds <= TPOT_S for seconds, decodes in steps[10:] if decodes)
    assert len(finished) == 60


def test_admission_refuses_what_cannot_meet_ttft_instead_of_missing_it_for_everyone():
    """A burst of 60 requests at once, TTFT target 0.5 s: without admission control most of
    them miss it (each waits for the prompts ahead of it); with it, the requests whose queued
    prompts ahead would take longer are refused at arrival and at least 90% of those admitted
    meet both targets."""
    targets = SloTargets(ttft_s=0.5, tpot_s=TPOT_S)
    _, finished, _ = _serve(SloPolicy(SloTargets(tpot_s=TPOT_S), 512, OnlineStepFit(StepPrior(*TRUE))), _load(gap_s=0))
    attained = sum(targets.met(s.first_token_at - s.arrival, _tpot(s)) for s in finished)
    assert attained < len(finished) / 2

    policy = SloPolicy(targets, 512, OnlineStepFit(StepPrior(*TRUE)))
    _, finished, refused = _serve(policy, _load(gap_s=0))
    assert refused and finished and policy.rejected == len(refused)
    attained = sum(targets.met(s.first_token_at - s.arrival, _tpot(s)) for s in finished)
    assert attained >= 0.9 * len(finished)


def test_refusal_message_names_the_target():
    policy = SloPolicy(SloTargets(ttft_s=0.1), 512, OnlineStepFit(StepPrior(*TRUE)))
    with pytest.raises(SloUnattainable, match=r"TTFT target of 100 ms \(--ttft-ms\)"):
        policy.check_admission(QueueShape(4, 400, (512,) * 100), 100)
    policy.check_admission(QueueShape(0, 0), 10)  # an idle server admits


@pytest.mark.parametrize("flags, message", [
    (["--ttft-ms", "0"], "--ttft-ms must be a positive number of milliseconds"),
    (["--tpot-ms", "nan"], "--tpot-ms must be a positive number of milliseconds"),
])
def test_bad_slo_flags(capsys, flags, message):
    """Checked before the model is looked at (the model path does not exist)."""
    from phalanx.testing.cli_errors import assert_cli_error

    assert_cli_error(["serve", "--model", "/nonexistent/model", *flags], capsys, message)
