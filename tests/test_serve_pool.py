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
    for values, message in ((["auto"], "serving planner"), (["latency"], "expected NAME:PLAN"),
                            (["a:tp=1", "a:tp=2"], "given twice"), (["Big:tp=1"], "expected NAME:PLAN")):
        with pytest.raises(UserError, match=message):
            parse_pools(values)


def test_bad_pool_flags_are_one_line(capsys):
    from phalanx.testing.cli_errors import assert_cli_error

    assert_cli_error(["serve", "--model", "/x", "--pool", "auto"], capsys, "--pool auto", "not there yet")
    assert_cli_error(["serve", "--model", "/x", "--pool", "a:tp=1", "--nproc", "2"], capsys, "drop --nproc")


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
    throughput.instances[0].in_flight = 5
    latency.instances[0].in_flight = 1
    for now in (0.0, 10.0):
        router.observe(now)
        assert router.plan_move(now) is None  # both busy
    latency.instances[0].in_flight = 0
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
            instance.ready, instance.in_flight = True, 0
    router.moving = True
    latency.instances[0].in_flight = 4
    router.observe(20.0)
    assert router.plan_move(30.0) is None  # a move is running
    router.moving = False
    back = router.plan_move(30.0)
    assert back.donor is throughput and back.give is throughput.instances[1] and back.donor_keeps == ()
    assert back.grow is latency.instances[0] and back.receiver_plan == "tp=2"


def test_a_pool_whose_layout_cannot_split_keeps_its_ranks():
    """An idle pool of one tp=1 instance has nothing to give; a layout the model cannot run
    (layout_ok) is never proposed."""
    router = Router([PoolSpec("latency", "tp=1", 1), PoolSpec("throughput", "tp=1", 1)], 1, 1.0)
    for pool in router.pools.values():
        pool.instances[0].ready = True
    router.pools["throughput"].instances[0].in_flight = 3
    router.observe(0.0)
    assert router.plan_move(5.0) is None
    router = Router([PoolSpec("latency", "tp=2", 2), PoolSpec("throughput", "tp=1", 1)], 1, 1.0,
                    layout_ok=lambda plan: plan != "tp=1")
    for pool in router.pools.values():
        pool.instances[0].ready = True
    router.pools["throughput"].instances[0].in_flight = 3
    router.observe(0.0)
    assert router.plan_move(5.0) is None


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
    with ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda p: _complete(server, p), prompts[:4]))
    _check(after, references[:4])
    finished = {k: v for k, v in server.metrics().items() if k.startswith("phalanx_requests_finished_total")}
    serving = {k.split('instance="')[1].split('"')[0] for k, v in finished.items() if 'pool="throughput"' in k and v}
    assert len(serving) == 2, finished  # the new instance served too
    assert not any("error" in k or "abort" in k for k in finished), finished


def _sigterm_stops_the_front_and_every_instance(server, prompts, references):
    """Last on the shared server: SIGTERM drains every instance and the front exits 0."""
    import signal

    server.signal(signal.SIGTERM)
    assert server.process.wait(120) == 0, "".join(server.stderr)
