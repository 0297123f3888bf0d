"""The serving simulator (planner/serve/simulate.py) on scripted arrivals, on a simulated clock:
it must make the scheduler's own decisions (admission, completion and preemption order) and
be deterministic; no timing of this machine enters."""

from __future__ import annotations

import json

import pytest

from phalanx.planner.serve.simulate import Arrival, simulate
from phalanx.scheduling.scheduler import Scheduler, Sequence

# A scripted trace: bursts and gaps, prompts longer than the token budget (chunked prefill),
# and a pool too small for everyone at once (preemption).
TRACE = [Arrival(0.0, 40, 6), Arrival(0.0, 20, 9), Arrival(0.01, 70, 4), Arrival(0.02, 10, 12),
         Arrival(0.2, 33, 5), Arrival(0.2, 48, 7), Arrival(0.21, 16, 3), Arrival(0.5, 64, 8)]
POOL = dict(num_blocks=14, block_size=8, max_batch=4, max_batch_tokens=32)


def step_cost(step) -> float:
    """A fixed cost of the step's shape: the simulator and the hand-driven loop share it."""
    return 0.004 + 0.0005 * step.num_tokens + 0.001 * len(step.chunks)


def _by_hand() -> tuple[list[str], list[str], list[tuple[str, float, float]], int]:
    """The scheduler driven directly: arrivals join before the step that starts after them,
    each step lasts step_cost, the clock jumps to the next arrival when idle."""
    now = [0.0]
    sched = Scheduler(num_blocks=POOL["num_blocks"], block_size=POOL["block_size"], max_num_seqs=POOL["max_batch"],
                      max_num_batched_tokens=POOL["max_batch_tokens"], max_waiting=100, clock=lambda: now[0])
    import random

    rng = random.Random(0)
    seqs, admitted, completed, nxt = [], [], [], 0
    while nxt < len(TRACE) or sched.has_work():
        while nxt < len(TRACE) and TRACE[nxt].at <= now[0]:
            a = TRACE[nxt]
            seq = Sequence.of(seq_id=f"r{nxt}", prompt=[rng.randrange(1, 2**31) for _ in range(a.prompt_tokens)],
                              max_tokens=a.output_tokens, arrival=a.at)
            sched.add(seq)
            seqs.append(seq)
            nxt += 1
        if not sched.has_work():
            now[0] = TRACE[nxt].at
            continue
        step = sched.schedule()
        for c in step.chunks:
            if c.seq.seq_id not in admitted:
                admitted.append(c.seq.seq_id)
        now[0] += step_cost(step)
        completed += [s.seq_id for s in sched.finish_step(step, {id(c.seq): 0 for c in step.chunks if c.samples})]
    return admitted, completed, [(s.seq_id, s.first_token_at, s.finished_at) for s in seqs], sched.preemptions


def test_simulator_makes_the_schedulers_decisions():
    """Same admission and completion order, same first-token and finish times, same number
    of preemptions (at least one: the pool holds 112 positions, the trace wants more)."""
    admitted, completed, times, preemptions = _by_hand()
    sim = simulate(TRACE, ranks=1, lockstep=False, step_seconds=step_cost, **POOL)
    assert sim.admitted == admitted and sim.completed == completed
    assert [s.seq_id for s in sim.requests] == [t[0] for t in times]
    got = [x for s in sim.requests for x in (s.first_token_at, s.finished_at)]
    assert got == pytest.approx([x for t in times for x in t[1:]], abs=1e-12)  # the same sums of step costs
    assert sim.preemptions == preemptions >= 1
    assert sorted(completed) == sorted(f"r{i}" for i in range(len(TRACE)))


@pytest.mark.parametrize("lockstep", [False, True])
def test_simulator_is_deterministic_over_dp_ranks(lockstep):
    """Two dp ranks (independent, or in lockstep as under ep): two runs give the same steps,
    orders and times; every request completes; in lockstep both ranks' steps coincide."""
    runs = [simulate(TRACE, ranks=2, lockstep=lockstep, step_seconds=step_cost, **POOL) for _ in range(2)]
    a, b = runs
    assert a.admitted == b.admitted and a.completed == b.completed and a.steps == b.steps
    assert len(a.completed) == len(TRACE)
    if lockstep:
        starts = {}
        for s in a.steps:
            starts.setdefault(s.start, set()).add(s.end)
        assert all(len(ends) == 1 for ends in starts.values())


def test_simulate_serve_command_writes_trace_png_and_summary(tmp_path, capsys):
    """`phalanx simulate --serve` on the tiny preset: the three files, a trace with the ranks'
    steps and the requests, and every simulated request completed."""
    from phalanx.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["simulate", "--serve", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "1", "--isl", "64",
              "--osl", "16", "--rate", "50", "--rates", "50", "--requests", "20", "--out", str(tmp_path)])
    assert exit.value.code == 0, capsys.readouterr().err
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("pid") == 0 and e["ph"] == "X" for e in trace) and any(e.get("pid") == 1 for e in trace)
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sweep"][0]["simulated"]["completed"] == 20


def test_simulate_serve_bad_input_is_one_line(capsys):
    from phalanx.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["simulate", "--serve", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "1", "--isl", "64",
              "--osl", "16", "--concurrency", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and "give --rate" in err[0]
