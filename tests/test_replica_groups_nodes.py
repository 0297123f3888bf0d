"""Replica groups across machines (`--replica-groups R --nnodes N`, or `MIN:MAX`): each machine's
launcher takes a node slot of the shared run directory and runs that slot's groups, numbered
across machines; all groups meet at one lighthouse given with `--lighthouse`.

"Machines" here are launchers on 127.0.0.1 with one run directory, as tests/test_launch.py's
--nnodes test runs them, and the lighthouse is torchft's own `torchft_lighthouse` with
phalanx's timeouts, as docs/fault_tolerance.md tells a user to start it. Equal to one process
to 1e-4 without failures and bit-equal states after a rejoin, for the reasons
tests/test_replica_groups.py's docstring gives.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RUST_LOG", "error")  # read when torchft is first imported: its quorum log lines off
pytest.importorskip("torchft")

from phalanx.errors import UserError  # noqa: E402
from phalanx.parallel.fault_tolerance import (  # noqa: E402
    DIGEST_ENV, HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS, QUORUM_TICK_MS,
)
from phalanx.ports import free_port  # noqa: E402
from phalanx.testing.cli_errors import assert_cli_error  # noqa: E402
from phalanx.train.collective_watch import STALL_ENV  # noqa: E402
from phalanx.train.config import TrainConfig  # noqa: E402
from phalanx.train.injected_faults import REJOIN_STALL_ENV  # noqa: E402
from phalanx.train.metrics import parse_lines, read_metrics  # noqa: E402
from phalanx.train.replica_groups import claim_node  # noqa: E402
from phalanx.train.restarts import FAULT_ENV  # noqa: E402
from tests.test_replica_groups import TINY, _digests, _run, assert_equal_to_one_process  # noqa: E402

ROOT = str(Path(__file__).parents[1])


@contextlib.contextmanager
def _lighthouse():
    """torchft's lighthouse in a process of its own, with phalanx's timeouts; its HOST:PORT."""
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"[::]:{port}",
                               "--min_replicas", "1", "--join_timeout_ms", str(JOIN_TIMEOUT_MS),
                               "--quorum_tick_ms", str(QUORUM_TICK_MS), "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)],
                              env={**os.environ, "RUST_LOG": "error"})
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the lighthouse did not start"
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def _node(argv, **env) -> subprocess.Popen:
    """One machine's `phalanx train` (a launcher of its own, as a user starts one per machine)."""
    return subprocess.Popen([sys.executable, "-m", "phalanx", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": ROOT, **env})


def _finish(nodes: list[subprocess.Popen]) -> list[tuple[int, list[str]]]:
    try:
        outputs = [node.communicate(timeout=240)[1] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    return [(node.returncode, err.strip().splitlines()) for node, err in zip(nodes, outputs)]


def _slots(results) -> list[str]:
    """What each machine's launcher said it runs, in slot order."""
    said = [line.split("(node slot ")[1].split(")")[0] for _, err in results for line in err if "(node slot " in line]
    return sorted(said)


def test_two_nodes_equal_one_process(tmp_path, capsys):
    """Two machines, one group of one process each (`--nnodes 2 --replica-groups 2 --nproc 1`):
    one takes slot 0 (group 0), the other slot 1 (group 1); losses, gradient norms and final
    weights equal a one-process run (1e-4); every row names both groups."""
    steps = ["--steps", "4", "--ckpt-every", "4"]
    assert _run([*TINY, *steps, "--nproc", "1", "--out", str(tmp_path / "one")], capsys)[0] == 0
    with _lighthouse() as address:
        argv = [*TINY, *steps, "--nproc", "1", "--nnodes", "2", "--replica-groups", "2", "--lighthouse", address,
                "--out", str(tmp_path / "ft")]
        results = _finish([_node(argv), _node(argv)])
    assert [code for code, _ in results] == [0, 0], results
    # Started together, the second to claim a slot joins the first one's launch.
    assert _slots(results) == ["0: group 0", "1: group 1, joining the running groups"], results
    assert_equal_to_one_process(tmp_path)


def test_a_killed_group_on_one_node_rejoins_while_the_other_node_steps(tmp_path):
    """Two machines, one group each. Group 1's worker SIGKILLs itself after step 3; its machine's
    launcher restarts it (held 3 s before its torchft manager starts, so that the lighthouse
    drops it), while the other machine's group 0 steps on alone, then stalls before step 6 for
    long enough that group 1 is back. No step is missing or repeated; group 1 is lost at step 4
    and rejoins by step 6; from the step it rejoined on, its state equals group 0's bit for bit."""
    run = tmp_path / "run"
    with _lighthouse() as address:
        argv = [*TINY, "--steps", "8", "--ckpt-every", "2", "--nproc", "1", "--nnodes", "2", "--replica-groups", "2",
                "--lighthouse", address, "--out", str(run)]
        env = {FAULT_ENV: "1:3:SIGKILL", REJOIN_STALL_ENV: "1:3", STALL_ENV: "0:6:15", DIGEST_ENV: "1"}
        results = _finish([_node(argv, **env), _node(argv, **env)])
    assert [code for code, _ in results] == [0, 0], results
    said = [line for _, err in results for line in err]
    assert ("phalanx: replica group 1: worker rank 0 exited with signal SIGKILL; restarting from its peers' live state "
            "(restart 1 of 3)") in said, said
    rows = parse_lines((run / "metrics.jsonl").read_text())[0]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == list(range(1, 9)), rows
    events = [row for row in rows if "event" in row]
    assert [(row["event"], row["group"]) for row in events] == [("group_lost", 1), ("group_rejoined", 1)], events
    lost, back = events[0]["step"], events[1]["step"]
    assert lost == 4 and lost < back <= 6, events
    assert all(row["groups"] == ([0] if lost <= row["step"] < back else [0, 1]) for row in steps), steps
    digests = _digests(run)
    assert sorted(digests) == list(range(1, 9))
    assert all(digests[step][0] == digests[step][1] for step in [1, 2, 3, *range(back, 9)]), digests


def test_a_node_that_starts_later_joins_an_elastic_run(tmp_path):
    """`--nnodes 1:2`: the first machine's group 0 starts alone (the first step waits for MIN = 1
    machine's groups), and stalls before step 5; a second machine started once step 3 is
    written takes the free slot 1 and its group 1 joins the running group by healing from its
    live state, as a machine that comes back after a loss does. No step missing; group 0 alone
    until group 1 rejoins, both after; from then on their states are bit-equal."""
    run = tmp_path / "run"
    with _lighthouse() as address:
        argv = [*TINY, "--steps", "7", "--ckpt-every", "2", "--nproc", "1", "--nnodes", "1:2", "--replica-groups", "2",
                "--lighthouse", address, "--out", str(run)]
        env = {STALL_ENV: "0:5:15", DIGEST_ENV: "1"}
        first = _node(argv, **env)
        deadline = time.monotonic() + 120
        metrics = run / "metrics.jsonl"
        while not (metrics.exists() and any(row.get("step") == 3 for row in read_metrics(metrics))):
            assert time.monotonic() < deadline and first.poll() is None, _finish([first])
            time.sleep(0.1)
        results = _finish([first, _node(argv, **env)])
    assert [code for code, _ in results] == [0, 0], results
    assert _slots(results) == ["0: group 0", "1: group 1, joining the running groups"], results
    rows = parse_lines((run / "metrics.jsonl").read_text())[0]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == list(range(1, 8)), rows
    events = [row for row in rows if "event" in row]
    assert [(row["event"], row["group"]) for row in events] == [("group_rejoined", 1)], events
    back = events[0]["step"]
    assert 5 <= back <= 7, events  # 5 unless the second machine took longer to start than group 0's 15 s stall
    assert all(row["groups"] == ([0] if row["step"] < back else [0, 1]) for row in steps), steps
    digests = _digests(run)
    assert all(digests[step][0] == digests[step][1] for step in range(back, 8)), digests


def test_node_slots(tmp_path):
    """`claim_node`: the lowest free slot; the groups of slot k are k x R/MAX onwards; a slot is
    free again once its holder closes it (its launcher gone), and the machine that takes it then
    joins the running launch; a machine too many, or one with another command, is one line."""
    cfg = TrainConfig(nnodes="2", replica_groups=4, out=str(tmp_path))
    first = claim_node(tmp_path, cfg, 2)
    assert first.turn is not None  # the others wait until its checks passed
    first.started()
    second = claim_node(tmp_path, cfg, 2)
    assert (first.rank, list(first.groups), first.joining) == (0, [0, 1], False)
    assert (second.rank, list(second.groups), second.joining) == (1, [2, 3], True)
    assert second.launch_id == first.launch_id
    with pytest.raises(UserError, match="all 2 node slots are taken: --nnodes 2 machines run it already"):
        claim_node(tmp_path, cfg, 2)
    first.lock.close()
    with pytest.raises(UserError, match="is being trained with --nproc 2 on the other nodes; run the same command"):
        claim_node(tmp_path, cfg, 4)
    again = claim_node(tmp_path, cfg, 2)
    assert (again.rank, again.joining, again.launch_id) == (0, True, first.launch_id)
    again.lock.close()
    second.lock.close()
    fresh = claim_node(tmp_path, cfg, 2)  # no machine left: a new launch
    assert (fresh.rank, fresh.joining) == (0, False) and fresh.launch_id != first.launch_id
    fresh.lock.close()
    fresh.turn.close()  # gave up before `started` (its one-line error): the next machine starts the launch
    last = claim_node(tmp_path, cfg, 2)
    assert last.joining is False
    last.started()
    last.lock.close()


def test_bad_node_settings_are_one_line(tmp_path, capsys):
    """R not dividing over the machines, groups per machine not dividing --nproc, no lighthouse
    (or no --out) with several machines: one line each, exit status 2, before anything starts."""
    out = ["--out", str(tmp_path / "r")]
    nodes = ["--nnodes", "2", "--lighthouse", "127.0.0.1:1"]  # checked after the counts: never reached
    assert_cli_error([*TINY, "--nproc", "1", "--replica-groups", "3", *nodes, *out], capsys,
                     "--replica-groups 3 must divide evenly over the 2 nodes of --nnodes (each node runs whole groups)")
    assert_cli_error([*TINY, "--nproc", "3", "--replica-groups", "4", *nodes, *out], capsys,
                     "--replica-groups 4 over 2 nodes is 2 groups per node, which must divide the 3 processes per node "
                     "(--nproc) evenly", one_line=False)
    assert_cli_error([*TINY, "--nproc", "1", "--replica-groups", "2", "--nnodes", "1:2", *out], capsys,
                     "--replica-groups with --nnodes 1:2 needs --lighthouse HOST:PORT")
    assert_cli_error([*TINY, "--nproc", "1", "--replica-groups", "2", *nodes], capsys,
                     "--replica-groups with --nnodes 2 needs --out DIR on a file system every machine sees")
    assert not (tmp_path / "r").exists()
