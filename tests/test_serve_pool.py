"""Per-class pools (`phalanx serve --pool NAME:PLAN ...`): the router's rules as plain logic on
a simulated clock, then one real server on 127.0.0.1 with two small pools (latency: tp=2,
throughput: tp=1) and the `openai` client: requests go to their class's pool, and under a
one-sided load a rank moves from the idle latency pool to the queued throughput pool (latency
re-shards to tp=1, throughput starts a second instance) while every request completes.
Every instance gets the front's other flags (here --tpot-ms). Outputs are compared with `transformers`' greedy generation, as a single pool's are in
tests/test_serve_http.py (near-tie rule of tests/serve_server.py: tp=2 sums row-parallel
matmuls in another order, ~1e-6)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from phalanx.errors import UserError
from phalanx.serve.pool_metrics import merge_metrics
from phalanx.serve.pool_router import PoolSpec, Router, UnknownClass, parse_pools


def _router(move_after_s: float = 5.0, max_num_seqs: int = 2) -> Router:
    router = Router([PoolSpec("latency", "tp=2", 2), PoolSpec("throughput", "tp=1", 1)], max_num_seqs, move_after_s)
    for pool in router.pools.values():
        for instance in pool.instances:
            instance.ready = True
    return router


def test_pool_flags():
    specs = parse_pools(["latency:tp=2", "throughput:tp=1"])
    assert [(s.name, s.plan, s.world) for s in specs] == [("latency", "tp=2", 2), ("throughput", "tp=1", 1)]
    for values, message in ((["auto", "a:tp=1"], "give it alone"), (["latency"], "expected NAME:PLAN"),
                            (["a:tp=1", "a:tp=2"], "given twice"), (["Big:tp=1"], "expected NAME:PLAN")):
        with pytest.raises(UserError, match=message):
            parse_pools(values)


def test_bad_pool_flags_are_one_line(capsys):
    from phalanx.testing.cli_errors import assert_cli_error

    assert_cli_error(["serve", "--model", "/x", "--pool", "a:tp=1", "--nproc", "2"], capsys, "drop --nproc")
    assert_cli_error(["serve", "--model", "/x", "--pool", "auto", "--nproc", "2"], capsys, "--ttft-ms/--tpot-ms")
    assert_cli_error(["serve", "--model", "/x", "--pool", "auto", "--tpot-ms", "50"], capsys,
                     "--nproc must be at least 2, got 1")
    assert_cli_error(["serve", "--model", "/x", "--pool", "auto", "--nproc", "2", "--tpot-ms", "50", "--plan", "tp=2"],
                     capsys, "drop --nproc and --plan")
    assert_cli_error(["serve", "--model", "/x", "--isl", "64"], capsys, "with --pool auto")
    assert_cli_error(["serve", "--model", "/x", "--pool", "a:tp=1", "--osl", "8"], capsys, "named pools do not use")


def test_pool_auto_refuses_what_it_cannot_plan_in_one_line(tmp_path, capsys, monkeypatch):
    """With the model read (a config.json, no weights needed to plan): targets no layout is
    predicted to meet, lengths beyond the model's positions."""
    import json

    from phalanx.testing.cli_errors import assert_cli_error

    monkeypatch.setenv("PHALANX_HOME", str(tmp_path))  # the local cluster's defaults, no calibration
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6}))
    auto = ["serve", "--model", str(tmp_path), "--pool", "auto", "--nproc", "2"]
    assert_cli_error(auto + ["--tpot-ms", "0.001"], capsys, "no latency pool of 1 rank meets --tpot-ms 0.001",
                     "predicted at TTFT")
    assert_cli_error(auto + ["--tpot-ms", "50", "--isl", "120", "--osl", "16"], capsys, "beyond the model's 128")
    # Named pools whose layout a single server would refuse: refused before any instance starts
    # (issue 36: one failed 38 s later, once its instances had tried to load).
    named = ["serve", "--model", str(tmp_path), "--pool", "b:tp=1"]
    assert_cli_error(named + ["--pool", "a:tp=3"], capsys, "--pool ...:tp=3: tp=3 must divide n_heads=4")
    assert_cli_error(named + ["--pool", "a:dp=2,ep=2"], capsys, "ep=2 needs a mixture-of-experts model")


def test_a_request_goes_to_its_class_pool():
    router = _router()
    latency, throughput = router.pools["latency"], router.pools["throughput"]
    assert router.classify("latency", "flex") is latency  # the header wins
    assert router.classify(None, "priority") is latency
    assert all(router.classify(None, tier) is throughput for tier in ("auto", "default", "flex", None))
    with pytest.raises(UnknownClass, match="pools are latency, throughput"):
        router.classify("batch", None)
    with pytest.raises(UnknownClass, match="service_tier must be one of"):
        router.classify(None, "scale")
    for odd in (["priority"], {"a": 1}, 3):  # issue 36: a list or object crashed the pool front
        with pytest.raises(UnknownClass, match="service_tier must be one of"):
            router.classify(None, odd)
    # Pools of other names: service tiers fall back to the first pool.
    other = Router([PoolSpec("a", "tp=1", 1), PoolSpec("b", "tp=1", 1)], 2, 5.0)
    assert other.classify(None, "priority") is other.pools["a"] and other.classify("b", None) is other.pools["b"]


def test_ranks_move_from_the_idle_pool_to_the_queued_one_only():
    """Simulated clock: throughput holds 5 requests (> its 2 seats) and latency none; after
    move_after_s (not before) one rank of latency's tp=2 instance moves: latency re-shards
    to tp=1 on rank 0, throughput starts a tp=1 instance on rank 1. No move while both pools
    are busy, and none while a move runs. Then, with the load reversed, throughput gives back
    its newest instance and latency re-shards back up to tp=2."""
    router = _router(move_after_s=5.0)
    latency, throughput = router.pools["latency"], router.pools["throughput"]
    throughput.instances[0].arrivals = [0.0] * 5
    latency.instances[0].arrivals = [0.0]
    for now in (0.0, 10.0):
        router.observe(now)
        assert router.plan_move(now) is None  # both busy
    latency.instances[0].arrivals = []
    router.observe(11.0)
    assert router.plan_move(11.0) is None and router.plan_move(15.9) is None
    move = router.plan_move(16.0)
    assert move.donor is latency and move.receiver is throughput
    assert move.donor_keeps == (0,) and move.freed == (1,) and move.grow is None and move.receiver_plan == "tp=1"
    assert "latency tp=2 -> tp=1 (drain, re-shard, resume)" in move.describe()

    # Carry the move out as the front does, then reverse the load.
    latency.instances = [router.new_instance("tp=1", (0,))]
    throughput.instances.append(router.new_instance("tp=1", (1,)))
    for pool in router.pools.values():
        pool.idle_since = pool.queued_since = None
        for instance in pool.instances:
            instance.ready, instance.arrivals = True, []
    router.moving = True
    latency.instances[0].arrivals = [20.0] * 4
    router.observe(20.0)
    assert router.plan_move(30.0) is None  # a move is running
    router.moving = False
    back = router.plan_move(30.0)
    assert back.donor is throughput and back.give is throughput.instances[1] and back.donor_keeps == ()
    assert back.grow is latency.instances[0] and back.receiver_plan == "tp=2"


def test_under_a_ttft_target_a_pool_queues_when_a_request_waits_past_it():
    """--ttft-ms 1000, 2 seats per instance, simulated clock: throughput's 4 requests arrived
    at 0 and 0.5 (two seated, two waiting). It counts as queued once its oldest waiting one has
    waited over 1 s (not at 1.0, yes at 1.3: the third oldest arrived at 0.3), not for being over
    its seats; and a move follows move_after_s later. Long-running seated requests never count
    (a pool at its seats decoding for minutes is not late); a request held in the router, with no
    instance, does; an instance's 429 for the TTFT target counts for one TTFT target's time."""
    router = Router([PoolSpec("latency", "tp=2", 2), PoolSpec("throughput", "tp=1", 1)], 2, 5.0, ttft_s=1.0)
    for pool in router.pools.values():
        pool.instances[0].ready = True
    latency, throughput = router.pools["latency"], router.pools["throughput"]
    throughput.instances[0].arrivals = [0.0, 0.0, 0.3, 0.5]  # over its 2 seats at once
    assert router.oldest_wait(throughput, 1.0) == pytest.approx(0.7)
    router.observe(1.0)
    assert throughput.queued_since is None and latency.idle_since == 1.0  # seats rule would say queued
    router.observe(1.3 + 1e-9)
    assert throughput.queued_since == pytest.approx(1.3)
    assert router.plan_move(6.2) is None  # latency idle since 1.0, throughput queued since 1.3
    move = router.plan_move(6.3 + 1e-9)
    assert move.donor is latency and move.receiver is throughput and move.freed == (1,)

    throughput.instances[0].arrivals = [0.0, 0.0]  # seated, decoding for 100 s: on time
    router.observe(100.0)
    assert throughput.queued_since is None
    latency.held_arrivals.append(99.5)  # no instance of latency open: waiting since 99.5
    latency.instances[0].ready = False
    router.observe(100.4)
    assert latency.queued_since is None
    router.observe(100.6)
    assert latency.queued_since == 100.6
    latency.held_arrivals.clear()
    router.note_refused(throughput, 101.0)
    router.observe(101.5)
    assert throughput.queued_since == 101.5 and latency.queued_since is None
    router.observe(102.1)
    assert throughput.queued_since is None  # the refusal is over a TTFT target ago


def test_a_pool_whose_layout_cannot_split_keeps_its_ranks():
    """An idle pool of one tp=1 instance has nothing to give; a layout the model cannot run
    (layout_ok) is never proposed."""
    router = Router([PoolSpec("latency", "tp=1", 1), PoolSpec("throughput", "tp=1", 1)], 1, 1.0)
    for pool in router.pools.values():
        pool.instances[0].ready = True
    router.pools["throughput"].instances[0].arrivals = [0.0] * 3
    router.observe(0.0)
    assert router.plan_move(5.0) is None
    router = Router([PoolSpec("latency", "tp=2", 2), PoolSpec("throughput", "tp=1", 1)], 1, 1.0,
                    layout_ok=lambda plan: plan != "tp=1")
    for pool in router.pools.values():
        pool.instances[0].ready = True
    router.pools["throughput"].instances[0].arrivals = [0.0] * 3
    router.observe(0.0)
    assert router.plan_move(5.0) is None


def _auto(ranks: int, *, ttft_ms=2000.0, tpot_ms=None, isl=512, osl=128):
    """`--pool auto`'s split of the `small` preset on the local cluster's defaults (the
    caller points PHALANX_HOME at an empty folder: no calibration file)."""
    from phalanx.layout_rules import tp_problem
    from phalanx.planner.hardware import cluster_from_name
    from phalanx.planner.model_spec import model_from_name
    from phalanx.planner.serve.rates import ServeLoad
    from phalanx.serve.pool_auto import auto_split

    model, cluster = model_from_name("small"), cluster_from_name("local")
    ok = lambda plan: not tp_problem(int(plan[3:]), n_heads=model.n_heads, n_kv_heads=model.n_kv_heads,  # noqa: E731
                                     ffn_dim=model.ffn_dim, vocab_size=model.vocab_size)
    load = ServeLoad(isl=isl, osl=osl, ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    common = dict(max_num_seqs=32, max_batch_tokens=512, weight_dtype="fp32", kv_dtype="fp32")
    return auto_split(model, cluster, ranks=ranks, load=load, layout_ok=ok, **common), (model, cluster, ok, common)


def test_pool_auto_takes_the_smallest_latency_pool_within_the_targets_and_the_rest_for_throughput(tmp_path,
                                                                                                  monkeypatch):
    """The split's laws, on the planner's own predictions (no process): every rank is used; the
    latency pool's layout is predicted within both targets, no smaller pool has a layout within
    them, and it ranks first (the planner's key) among its size's layouts within them; the
    throughput pool's layout ranks first among its size's without targets; and a tighter TPOT
    target never gives the latency pool a slower predicted TPOT (nor fewer ranks)."""
    from phalanx.planner.serve.rates import ServeLoad
    from phalanx.serve.pool_auto import meets, pool_layouts, rate_pool

    monkeypatch.setenv("PHALANX_HOME", str(tmp_path))
    for ranks in (2, 4, 8):
        previous = None
        for tpot in (400.0, 100.0, 50.0, 30.0, 20.0, 15.0):
            try:
                split, (model, cluster, ok, common) = _auto(ranks, tpot_ms=tpot)
            except UserError as error:
                assert "no latency pool" in str(error) and tpot <= 20  # only the tightest are out of reach
                continue
            lat, thr = split.latency, split.throughput
            assert lat.ranks + thr.ranks == ranks and lat.ranks >= 1 and thr.ranks >= 1
            assert meets(lat.plan, split.load) and lat.plan.rates.tpot_p50_s * 1e3 <= tpot
            rate = lambda size, load: [rate_pool(model, cluster, tp, n, load, world=ranks, **common)  # noqa: E731
                                       for tp, n in pool_layouts(size, ok)]
            for size in range(1, lat.ranks):
                assert not any(meets(p, split.load) for p in rate(size, split.load))
            assert lat.plan.key == max(p.key for p in rate(lat.ranks, split.load) if meets(p, split.load))
            assert thr.plan.key == max(p.key for p in rate(thr.ranks, ServeLoad(isl=512, osl=128)))
            if previous is not None:
                assert lat.plan.rates.tpot_p50_s <= previous.plan.rates.tpot_p50_s * (1 + 1e-9)
                assert lat.ranks >= previous.ranks
            previous = lat
    # On 8 ranks the planner needs tp=2 for 20 ms (one rank's fastest is slower) and one rank for 50 ms.
    assert _auto(8, tpot_ms=50.0)[0].latency.ranks == 1
    tight = _auto(8, tpot_ms=20.0)[0]
    assert (tight.latency.tp, tight.latency.instances, tight.throughput.tp, tight.throughput.instances) == (2, 1, 1, 6)
    lines = tight.lines()
    assert lines[0].startswith("pool auto: latency tp=2 on 2 ranks: predicted TTFT") and "(target 20)" in lines[0]
    assert lines[1].startswith("pool auto: throughput 6 x tp=1 on 6 ranks: predicted") and "per rank" in lines[1]


def test_pool_auto_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, phalanx.serve.pool_auto; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pool_auto_refusals_and_lengths():
    from phalanx.model.config import PRESETS
    from phalanx.serve.pool_auto import check_auto, planned_lengths

    with pytest.raises(UserError, match="give at least one"):
        check_auto(ttft_ms=None, tpot_ms=None, ranks=4)
    with pytest.raises(UserError, match="at least 2, got 1"):
        check_auto(ttft_ms=100.0, tpot_ms=None, ranks=1)
    tiny = PRESETS["tiny"]  # 256 positions: the defaults shortened to them
    assert planned_lengths(PRESETS["small"], None, None) == (512, 128)
    assert planned_lengths(tiny, None, None) == (204, 52) and planned_lengths(tiny, 100, None) == (100, 128)
    with pytest.raises(UserError, match="beyond the model's 256 positions"):
        planned_lengths(tiny, 200, 100)


def test_an_auto_pool_starts_with_its_instances_on_consecutive_ranks():
    router = Router([PoolSpec("latency", "tp=2", 2), PoolSpec("throughput", "tp=1", 1, instances=3)], 2, 5.0)
    assert [i.ranks for i in router.pools["latency"].instances] == [(0, 1)]
    assert [i.ranks for i in router.pools["throughput"].instances] == [(2,), (3,), (4,)]
    assert router.pools["throughput"].ranks == 3


def test_service_tier_is_checked_by_a_single_server_too():
    from phalanx.serve.api_requests import ApiError, parse_completion

    parse_completion({"prompt": "x", "service_tier": "flex"})
    with pytest.raises(ApiError, match="service_tier must be one of priority, auto, default, flex"):
        parse_completion({"prompt": "x", "service_tier": "fast"})


def test_metrics_of_instances_merge_into_one_family_each():
    text = ('# HELP x_total X\n# TYPE x_total counter\nx_total{reason="a"} 1.0\n'
            '# HELP y Y\n# TYPE y gauge\ny 2.0\n')
    merged = merge_metrics([({"pool": "p", "instance": "0"}, text), ({"pool": "q", "instance": "1"}, text)])
    assert merged.splitlines() == [
        "# HELP x_total X", "# TYPE x_total counter", 'x_total{pool="p",instance="0",reason="a"} 1.0',
        'x_total{pool="q",instance="1",reason="a"} 1.0', "# HELP y Y", "# TYPE y gauge",
        'y{pool="p",instance="0"} 2.0', 'y{pool="q",instance="1"} 2.0']


# A real server

pytest.importorskip("openai")
pytest.importorskip("transformers")

NEW = 10


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    import torch

    from tests.hf_models import VOCAB, write_checkpoint
    from tests.serve_server import ServeProcess, transformers_greedy

    folder = write_checkpoint(tmp_path_factory.mktemp("pools") / "llama", "llama")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
               for n in torch.randint(4, 25, (12,), generator=generator)]
    server = ServeProcess(folder, "--pool", "latency:tp=2", "--pool", "throughput:tp=1", "--max-num-seqs", "1",
                          "--block-size", "8", "--pool-move-after", "0.5", "--shutdown-grace", "1",
                          "--tpot-ms", "1000")  # passed on to every instance: their SLO counters below
    try:
        yield server, prompts, transformers_greedy(folder, prompts, NEW)
    finally:
        server.stop()


def _complete(server, prompt, service_tier=None, **kw):
    extra = {"return_token_ids": True} | ({"service_tier": service_tier} if service_tier else {})
    return server.client().completions.create(model=server.name, prompt=prompt, max_tokens=NEW, temperature=0,
                                              extra_body=extra, **kw).choices[0].token_ids


def _check(answers, references):
    from tests.serve_server import assert_greedy_equal

    for ours, (reference, logits) in zip(answers, references):
        assert_greedy_equal(ours, reference, logits)


def test_pools_route_move_ranks_and_stop(pools):
    """One server through its life, in order (one test, so that pytest-xdist cannot give its
    phases to two workers, each starting the pools, 30 s apiece): routed by class, a rank moved
    under a one-sided load, SIGTERM."""
    _requests_are_routed_by_class_and_equal_one_process(*pools)
    _a_rank_moves_to_the_queued_pool_and_no_request_fails(*pools)
    _sigterm_stops_the_front_and_every_instance(*pools)


def _requests_are_routed_by_class_and_equal_one_process(server, prompts, references):
    """Header or service_tier picks the pool; both pools' answers equal transformers'.
    Throughput's requests go one at a time, within its one seat, so that no rank moves yet."""
    with ThreadPoolExecutor(4) as pool:
        latency = list(pool.map(lambda p: _complete(server, p, service_tier="priority"), prompts[:2]))
        header = [_complete(server, prompts[2], extra_headers={"X-Phalanx-Class": "latency"})]
    throughput = [_complete(server, p) for p in prompts[3:5]]
    _check(latency + header + throughput, references[:5])
    metrics = server.metrics()
    assert metrics['phalanx_pool_requests_total{pool="latency"}'] == 3
    assert metrics['phalanx_pool_requests_total{pool="throughput"}'] == 2
    # Every instance schedules for --tpot-ms and counts each finished request as attained or missed.
    for pool, count in (("latency", 3), ("throughput", 2)):
        assert sum(v for k, v in metrics.items() if k.startswith(("phalanx_slo_attained_total", "phalanx_slo_missed_total"))
                   and f'pool="{pool}"' in k) == count


def _a_rank_moves_to_the_queued_pool_and_no_request_fails(server, prompts, references):
    """12 throughput requests in flight (one seat) while latency idles: a rank moves (the log's
    event line, /metrics). Latency requests sent during the move are held until latency's
    re-sharded instance is up. Every request completes with transformers' tokens, and
    afterwards throughput runs two instances, one of them on the moved rank."""
    with ThreadPoolExecutor(16) as pool:
        first: list[tuple[int, object]] = []  # (prompt index, future): 12 in flight until the move starts
        deadline = time.monotonic() + 300
        while not any("phalanx: pool move:" in line for line in server.stderr):
            assert time.monotonic() < deadline, "".join(server.stderr)
            while sum(not f.done() for _, f in first) < len(prompts):
                index = len(first) % len(prompts)
                first.append((index, pool.submit(_complete, server, prompts[index])))
            time.sleep(0.05)
        # One at a time, within latency's seat: held during the move, not a queue that pulls ranks back.
        during = pool.submit(lambda: [_complete(server, p, service_tier="priority") for p in prompts[:2]])
        _check([f.result() for _, f in first], [references[i] for i, _ in first])
        _check(during.result(), references[:2])
    while not server.metrics().get('phalanx_pool_moves_total{from="latency",to="throughput"}'):
        assert time.monotonic() < deadline, "".join(server.stderr)
        time.sleep(0.2)
    metrics = server.metrics()
    assert metrics['phalanx_pool_moves_total{from="latency",to="throughput"}'] == 1
    assert metrics['phalanx_pool_ranks{pool="latency"}'] == 1 and metrics['phalanx_pool_ranks{pool="throughput"}'] == 2
    assert metrics['phalanx_pool_instances{pool="throughput"}'] == 2
    # The router counts an instance from its start and sends it requests once it answers: rounds
    # of 4 at once until the new one has served (each round's tokens checked), within the deadline.
    while True:
        with ThreadPoolExecutor(4) as pool:
            after = list(pool.map(lambda p: _complete(server, p), prompts[:4]))
        _check(after, references[:4])
        finished = {k: v for k, v in server.metrics().items() if k.startswith("phalanx_requests_finished_total")}
        serving = {k.split('instance="')[1].split('"')[0] for k, v in finished.items() if 'pool="throughput"' in k and v}
        if len(serving) == 2 or time.monotonic() > deadline:
            break
    assert len(serving) == 2, finished  # the new instance served too
    assert not any("error" in k or "abort" in k for k in finished), finished


def _sigterm_stops_the_front_and_every_instance(server, prompts, references):
    """Last on the shared server: SIGTERM drains every instance and the front exits 0."""
    import signal

    server.signal(signal.SIGTERM)
    assert server.process.wait(120) == 0, "".join(server.stderr)
