"""Pure pieces of the pipeline runtime: which stages a rank holds, and the bubble formulas."""

from __future__ import annotations

import pytest

from phalanx.parallel.pipeline import bubble_formula, stages_of_rank
from phalanx.plan import Plan


@pytest.mark.parametrize("plan, expected", [
    (Plan(pp=4), [[0], [1], [2], [3]]),
    (Plan(pp=2, schedule="interleaved", virtual=3, microbatches=4), [[0, 2, 4], [1, 3, 5]]),
    # V shape: the first and the last stage share rank 0, so the loss is computed there.
    (Plan(pp=4, schedule="zbv", virtual=2, microbatches=8), [[0, 7], [1, 6], [2, 5], [3, 4]]),
    (Plan(pp=2, schedule="dualpipev", virtual=2, microbatches=4), [[0, 3], [1, 2]]),
])
def test_stage_placement(plan, expected):
    assert [stages_of_rank(plan, rank) for rank in range(plan.pp)] == expected


@pytest.mark.parametrize("plan, expected", [
    (Plan(pp=4, schedule="gpipe", microbatches=8), 3 / 11),   # (p - 1) / (m + p - 1)
    (Plan(pp=4, microbatches=8), 3 / 11),                     # 1f1b: same bubble, less memory
    (Plan(pp=2, schedule="interleaved", virtual=2, microbatches=4), 1 / 9),  # (p - 1) / (v m + p - 1)
    # p = 4: each warm-up slot is a v-times-smaller chunk, so v m counts chunk-sized slots.
    (Plan(pp=4, schedule="interleaved", virtual=2, microbatches=4), 3 / 11),   # 3 / (2*4 + 3)
    (Plan(pp=4, schedule="interleaved", virtual=2, microbatches=8), 3 / 19),   # 3 / (2*8 + 3)
    (Plan(pp=4, schedule="interleaved", virtual=4, microbatches=8), 3 / 35),   # 3 / (4*8 + 3)
    (Plan(pp=4, schedule="zbv", virtual=2, microbatches=8), 0.0),
    (Plan(pp=4, schedule="dualpipev", virtual=2, microbatches=8), 0.0),
    (Plan(dp=2), 0.0),
])
def test_bubble_formula(plan, expected):
    assert bubble_formula(plan) == pytest.approx(expected, rel=1e-15, abs=0)


def test_wait_clock_replaces_the_wait_only_inside_its_step():
    """The step's clock times the schedule's transfer waits through
    `schedules._wait_batch_p2p` while its step runs, and leaves the process's function as it
    found it afterwards (also after an error), so no other schedule sees the wrapper."""
    from torch.distributed.pipelining import schedules

    from phalanx.train.pipeline_step import WaitClock

    original = schedules._wait_batch_p2p
    clock = WaitClock()
    with clock.timing():
        assert schedules._wait_batch_p2p is not original
        schedules._wait_batch_p2p([])  # no work to wait for: returns at once, and is counted
    assert schedules._wait_batch_p2p is original and clock.available and clock.seconds >= 0
    with pytest.raises(RuntimeError), WaitClock().timing():
        raise RuntimeError("a failing step")
    assert schedules._wait_batch_p2p is original
