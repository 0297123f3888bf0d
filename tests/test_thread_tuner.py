"""The serving engine's thread count re-decided from its steps' speed (phalanx/thread_tuner.py):
the policy on a clock of its own (each count's seconds per token given), then the engine
applying it to torch."""

from __future__ import annotations

import pytest

from phalanx.thread_tuner import ThreadTuner
from phalanx.threads import choose_threads


def _serve(tuner: ThreadTuner, steps: int, per_token: dict[int, float], tokens: int = 4) -> list[int]:
    """`steps` steps of `tokens` each, every count's step taking per_token[count] a token; the
    count each step ran on."""
    ran = []
    for _ in range(steps):
        count = tuner.next_threads()
        ran.append(count)
        tuner.observe(per_token[count] * tokens, tokens)
    return ran


def test_a_quiet_machine_keeps_every_core():
    tuner = ThreadTuner(2, every=20, probe=3)
    ran = _serve(tuner, 200, {2: 0.010, 1: 0.018})
    assert tuner.current == 2 and tuner.switches == []
    # A cycle is 20 steps on the current count, then a probe of 3 + 3: 7 whole cycles in 200.
    assert ran.count(1) == 3 * (200 // 26), "three steps on one thread per probe, no more"


def test_a_busy_core_drops_to_half_and_comes_back_when_it_frees():
    tuner = ThreadTuner(2, every=20, probe=3)
    _serve(tuner, 10, {2: 0.010, 1: 0.018})
    assert tuner.current == 2
    _serve(tuner, 30, {2: 0.040, 1: 0.020})  # another process took a core: two threads wait on it
    assert tuner.current == 1 and tuner.switches == [(2, 1, 0.5)]
    _serve(tuner, 40, {2: 0.010, 1: 0.018})  # it ended
    assert tuner.current == 2 and tuner.switches[-1] == (1, 2, pytest.approx(0.010 / 0.018))


def test_within_the_margin_nothing_changes():
    tuner = ThreadTuner(2, every=20, probe=3, margin=0.1)
    _serve(tuner, 200, {2: 0.010, 1: 0.0095})  # 5% faster: noise, not worth a flip
    assert tuner.switches == []


def test_a_probe_alternates_so_both_counts_meet_the_same_batch():
    tuner = ThreadTuner(4, every=8, probe=4)
    assert tuner.candidates == (4, 2)
    ran = _serve(tuner, 16, {4: 0.01, 2: 0.02})
    assert ran[8:16] == [4, 2, 2, 4, 4, 2, 2, 4]


def test_steps_without_tokens_decide_nothing_and_one_core_never_probes():
    tuner = ThreadTuner(2, every=4, probe=2)
    _serve(tuner, 20, {2: 0.05, 1: 0.01}, tokens=0)
    assert tuner.switches == []
    single = ThreadTuner(1, every=4, probe=2)
    assert set(_serve(single, 20, {1: 0.01})) == {1}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="every >= 2"):
        ThreadTuner(2, every=3, probe=2)


def test_only_an_automatic_count_is_tuned():
    assert choose_threads(cores=2, local_ranks=1, environ={}).automatic
    assert not choose_threads(requested=2, cores=2, local_ranks=1, environ={}).automatic
    assert not choose_threads(cores=2, local_ranks=1, environ={"OMP_NUM_THREADS": "2"}).automatic


def test_the_engine_applies_the_count(tmp_path, monkeypatch, capsys):
    """An Engine with a tuner sets torch's thread count before each step as the tuner says, and
    says a switch in one line; the tokens are the same as without one."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import phalanx.hf as hf
    from phalanx.scheduling.scheduler import Scheduler, Sequence
    from phalanx.serve.engine import Engine
    from phalanx.serve.sampling_params import request_sampling
    from tests.hf_models import write_checkpoint

    model = hf.load(write_checkpoint(tmp_path / "llama", "llama"))
    outputs, applied = [], []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: applied.append(n) or real(n))
    threads = torch.get_num_threads()
    try:
        for tuner in (None, ThreadTuner(2, every=4, probe=2, margin=0.0)):
            scheduler = Scheduler(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_waiting=4)
            engine = Engine(model, scheduler, tuner=tuner)
            if tuner is not None:  # one thread made to look twice as fast: the probe takes it
                clock = iter(range(10_000))
                monkeypatch.setattr("phalanx.serve.engine.time.perf_counter",
                                    lambda: next(clock) * (0.5 if torch.get_num_threads() == 1 else 1.0))
            scheduler.add(Sequence.of("a", [1, 2, 3], 20, params=request_sampling(0, 1, None, 0)))
            tokens = []
            while scheduler.has_work():
                tokens += [event.token for event in engine.step()]
            outputs.append(tokens)
    finally:
        real(threads)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 20
    assert 1 in applied and tuner.current == 1
    assert "phalanx: intra-op threads 2 -> 1" in capsys.readouterr().err


def test_the_server_tunes_only_one_cpu_process_with_an_automatic_count(monkeypatch):
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from phalanx.serve.cli import thread_tuner

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("phalanx.threads.physical_cores", lambda cpus, sysfs=None: 4)
    cpu, automatic = torch.device("cpu"), SimpleNamespace(threads=0)
    assert thread_tuner(automatic, 1, cpu).candidates == (3, 1), "a core kept for the HTTP threads, then half"
    assert thread_tuner(automatic, 2, cpu) is None, "ranks in lockstep"
    assert thread_tuner(automatic, 1, torch.device("cuda")) is None, "a GPU's steps are not the CPU threads'"
    assert thread_tuner(SimpleNamespace(threads=3), 1, cpu) is None, "--threads 3 is kept"
    monkeypatch.setattr("phalanx.threads.physical_cores", lambda cpus, sysfs=None: 2)
    assert thread_tuner(automatic, 1, cpu) is None, "2 cores: 1 thread beside the server's own, nothing to tune"
