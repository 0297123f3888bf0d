"""Replica groups (`--replica-groups R`, torchft): equal to one process without failures; a
killed group restarts and rejoins from its peers while the others keep stepping.

Without failures the R groups split the global batch as R x dp data-parallel ranks: each
group's ranks average their gradients (DDP), the groups average theirs through torchft's
all-reduce, so the step's gradient is the mean over the global batch, as in one process. The
sums run in another order (two levels of gloo ring all-reduce against one backward over the
whole batch), so values agree to float32 rounding, not bit for bit: 1e-4 relative (measured:
about 1e-7 on the losses of tiny). After a rejoin, the rejoined group received the weights and
optimizer state of a peer (copied bytes) and from then on does the same arithmetic on the same
summed gradients, so its state digest equals its peer's exactly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

os.environ.setdefault("RUST_LOG", "error")  # read when torchft is first imported: its quorum log lines off
pytest.importorskip("torchft")

from phalanx.checkpoint.store import latest_checkpoint  # noqa: E402
from phalanx.cli import main  # noqa: E402
from phalanx.parallel.fault_tolerance import DIGEST_ENV  # noqa: E402
from phalanx.ports import free_port  # noqa: E402
from phalanx.testing.cli_errors import assert_cli_error  # noqa: E402
from phalanx.train.collective_watch import STALL_ENV  # noqa: E402
from phalanx.train.injected_faults import IN_STEP_FAULT_ENV, IN_STEP_STALL_ENV, REJOIN_STALL_ENV  # noqa: E402
from phalanx.train.metrics import parse_lines, read_metrics  # noqa: E402
from phalanx.train.restarts import FAULT_ENV  # noqa: E402

TINY = ["train", "--model", "tiny", "--global-batch", "4", "--seq-len", "16", "--no-progress", "--no-plot",
        "--sample-tokens", "0", "--eval-every", "0", "--device", "cpu", "--collective-timeout", "60"]


def _run(argv, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()


def _launch(argv, **env) -> tuple[int, list[str]]:
    """`phalanx argv` as a process of its own, as a user starts it: the launcher forks the
    lighthouse and the groups' launchers, which a pytest process that already ran training
    in itself (its threads, its locks) should not be forking (seen: a second run hung at step 1)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "phalanx", *argv], capture_output=True, text=True, timeout=280,
                          env={**os.environ, **env})
    return done.returncode, done.stderr.strip().splitlines()


def _final_weights(run: Path, scratch: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(str(latest_checkpoint(run)[1]), str(scratch))
    return torch.load(scratch, weights_only=False)["model"]


def assert_equal_to_one_process(tmp_path: Path) -> None:
    """The run in tmp_path/ft (4 steps, both groups in every step) against the one-process run
    in tmp_path/one: losses and gradient norms (1e-4) and the final weights."""
    one, ft = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "ft" / "metrics.jsonl")
    assert [row["step"] for row in ft] == [1, 2, 3, 4] and all(row["groups"] == [0, 1] for row in ft), ft
    for key in ("loss", "grad_norm"):
        assert [row[key] for row in ft] == pytest.approx([row[key] for row in one], rel=1e-4), key
    got, want = _final_weights(tmp_path / "ft", tmp_path / "ft.pt"), _final_weights(tmp_path / "one", tmp_path / "one.pt")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("plan", [None, "dp=2,zero=3", "tp=2", "pp=2,microbatches=2", "cp=2"],
                         ids=["ddp", "fsdp", "tp", "pp", "cp"])
def test_two_groups_of_two_equal_one_process(tmp_path, capsys, plan):
    """4 processes as 2 replica groups of dp=2 (DDP inside each group; or FSDP2 sharding inside
    each group and replication across them, as HSDP; or tp=2, pp=2 or cp=2 inside each group): losses,
    gradient norms and final weights equal a one-process run (1e-4, see the module docstring);
    every row names both groups."""
    steps = ["--steps", "4", "--ckpt-every", "4"]
    assert _run([*TINY, *steps, "--nproc", "1", "--out", str(tmp_path / "one")], capsys)[0] == 0
    code, err = _launch([*TINY, *steps, "--nproc", "4", "--replica-groups", "2", "--out", str(tmp_path / "ft"),
                         *(["--plan", plan] if plan else [])],
                        PYTHONPATH=str(Path(__file__).parents[1]))
    assert code == 0, err
    assert any(f"on 4 processes in 2 replica groups of 2, plan {plan or 'dp=2'}," in line for line in err), err
    assert_equal_to_one_process(tmp_path)


def test_killed_group_rejoins_from_its_peer(tmp_path):
    """2 groups of one process. Group 1 SIGKILLs itself after step 3; group 0 goes on alone
    (steps 4 and 5 name only group 0: restarted, group 1 is held 5 s before its manager starts),
    then stalls before step 6 for long enough that group 1 is back and waiting at the quorum: a quorum cannot form without
    a group that is still heartbeating, so group 1 joins step 6, receiving group 0's live state.
    No step is missing or repeated; event rows say when group 1 was lost and rejoined; from
    the step it rejoined on, its model and optimizer state equal group 0's bit for bit."""
    run = tmp_path / "run"
    code, err = _launch([*TINY, "--steps", "8", "--ckpt-every", "2", "--nproc", "2", "--replica-groups", "2", "--out", str(run)],
                        **{FAULT_ENV: "1:3:SIGKILL",  # global rank 1: group 1's only rank
                           # Restarted, group 1 waits 5 s before its torchft manager starts: its restart
                           # alone (forked from a forkserver with everything imported) can be back within
                           # the lighthouse's heartbeat timeout, and then no step runs without it.
                           REJOIN_STALL_ENV: "1:5",
                           STALL_ENV: "0:6:30",  # group 0, before step 6 (a restart took 10-20 s on 2 loaded cores)
                           DIGEST_ENV: "1", "PYTHONPATH": str(Path(__file__).parents[1])})
    assert code == 0, err
    assert ("phalanx: replica group 1: worker rank 0 exited with signal SIGKILL; restarting from its peers' live state "
            "(restart 1 of 3)") in err, err
    rows = parse_lines((run / "metrics.jsonl").read_text())[0]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == list(range(1, 9)), rows
    assert [row["groups"] for row in steps] == [[0, 1]] * 3 + [[0]] * 2 + [[0, 1]] * 3, rows
    events = [row for row in rows if "event" in row]
    assert events == [{"event": "group_lost", "step": 4, "group": 1}, {"event": "group_rejoined", "step": 6, "group": 1}]
    digests: dict[int, dict[int, str]] = {}
    for line in (run / "state_digests.jsonl").read_text().splitlines():
        entry = json.loads(line)
        digests.setdefault(entry["step"], {})[entry["group"]] = entry["digest"]
    assert sorted(digests) == list(range(1, 9))
    assert [sorted(digests[step]) for step in range(1, 9)] == [[0, 1]] * 3 + [[0]] * 2 + [[0, 1]] * 3
    assert all(digests[step][0] == digests[step][1] for step in (1, 2, 3, 6, 7, 8))


@pytest.mark.parametrize("fault", [{FAULT_ENV: "3:3:SIGKILL"}, {IN_STEP_FAULT_ENV: "3:4:SIGKILL"}],
                         ids=["between-steps", "in-a-step"])
def test_a_group_of_two_with_a_dead_worker_restarts_and_rejoins(tmp_path, fault):
    """2 groups of 2 processes; group 1's rank 1 SIGKILLs itself, while its rank 0 goes on into
    torchft's quorum or all-reduce (which parallel/broken_group.py then ends; that the watch
    ends such a wait at once, and only then, is tests/test_broken_group.py's). Either after
    step 3, or in step 4 after its backward: then group 0's all-reduce of step 4 breaks (rank 1's
    at once; rank 0's may go through with group 1's rank 0, but the group's commit fails), and
    group 0 runs that all-reduce again with its own step-4 gradients at a new quorum, without
    group 1 or with it restarted. The group restarts and rejoins (missing a step or not,
    depending on how fast it is back); no step is missing or repeated, its loss and rejoin are
    event rows, and from the step it rejoined on its state equals group 0's bit for bit."""
    run = tmp_path / "run"
    code, err = _launch([*TINY, "--steps", "8", "--ckpt-every", "2", "--nproc", "4", "--replica-groups", "2", "--out", str(run)],
                        **{**fault,  # group 1, rank 1 (group x 2 + rank)
                           # Group 0 waits before step 6 for group 1 to be back (tiny's steps take
                           # milliseconds; a group's restart took 3.0-7.1 s in benchmarks/goodput.py
                           # on the loaded 2-core machine).
                           STALL_ENV: "0:6:15", DIGEST_ENV: "1", "PYTHONPATH": str(Path(__file__).parents[1])})
    assert code == 0, err
    assert ("phalanx: replica group 1: worker rank 1 exited with signal SIGKILL; restarting from its peers' live state "
            "(restart 1 of 3)") in err, err
    assert not any("Traceback" in line for line in err), err  # torchft's tracebacks of the lost all-reduce: quiet
    rows = parse_lines((run / "metrics.jsonl").read_text())[0]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == list(range(1, 9)), rows
    events = [row for row in rows if "event" in row]
    assert [(row["event"], row["group"]) for row in events] == [("group_lost", 1), ("group_rejoined", 1)], events
    lost, back = events[0]["step"], events[1]["step"]
    assert 4 <= lost <= back <= 6
    assert all(row["groups"] == ([0] if lost <= row["step"] < back else [0, 1]) for row in steps), steps
    digests: dict[int, dict[int, str]] = {}
    for line in (run / "state_digests.jsonl").read_text().splitlines():
        entry = json.loads(line)
        digests.setdefault(entry["step"], {})[entry["group"]] = entry["digest"]
    assert all(digests[step][0] == digests[step][1] for step in [*range(1, 4), *range(back, 9)])


def _digests(run: Path) -> dict[int, dict[int, str]]:
    digests: dict[int, dict[int, str]] = {}
    for line in (run / "state_digests.jsonl").read_text().splitlines():
        entry = json.loads(line)
        digests.setdefault(entry["step"], {})[entry["group"]] = entry["digest"]
    return digests


def test_a_group_back_in_the_middle_of_a_step_sits_it_out(tmp_path):
    """2 groups of one process. Group 1 SIGKILLs itself in step 4 after its backward; group 0,
    held after its own backward until group 1 is restarted and waiting at its quorum, finds its
    all-reduce broken and meets group 1 at the new quorum, in the middle of step 4 (its
    gradients of step 4 computed): group 1 receives group 0's state and sits step 4 out (no
    forward and backward: group 0 would wait for them), adding zero gradients, and is not
    counted among the groups present. Step 4's row names group 0 alone and its loss is group
    0's; from step 4 on group 1's state equals group 0's bit for bit (it applied the same
    averaged gradient); it takes part again from step 5."""
    run = tmp_path / "run"
    code, err = _launch([*TINY, "--steps", "6", "--ckpt-every", "2", "--nproc", "2", "--replica-groups", "2", "--out", str(run)],
                        **{IN_STEP_FAULT_ENV: "1:4:SIGKILL",
                           # Group 1's restart takes about a second (10-20 s seen on 2 loaded cores before
                           # the forkservers); group 0 waits at most this long for it.
                           IN_STEP_STALL_ENV: "0:4:20",
                           DIGEST_ENV: "1", "PYTHONPATH": str(Path(__file__).parents[1])})
    assert code == 0, err
    rows = parse_lines((run / "metrics.jsonl").read_text())[0]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == list(range(1, 7)), rows
    assert [row["groups"] for row in steps] == [[0, 1]] * 3 + [[0]] + [[0, 1]] * 2, rows
    events = [row for row in rows if "event" in row]
    assert events == [{"event": "group_lost", "step": 4, "group": 1}, {"event": "group_rejoined", "step": 5, "group": 1}]
    digests = _digests(run)
    assert sorted(digests) == list(range(1, 7)) and all(sorted(digests[step]) == [0, 1] for step in digests), digests
    assert all(digests[step][0] == digests[step][1] for step in range(1, 7)), digests


LIGHTHOUSE = """
import sys, time
from torchft.coordination import LighthouseServer
server = LighthouseServer(bind="[::]:" + sys.argv[1], min_replicas=1)
print("up", flush=True)
time.sleep(600)
"""


def test_a_lighthouse_already_running(tmp_path):
    """`--lighthouse HOST:PORT`: the groups meet at a lighthouse started beforehand (as with
    --nnodes one would be), and phalanx starts none of its own."""
    import subprocess
    import sys

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", LIGHTHOUSE, str(port)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RUST_LOG": "error"})
    try:
        assert server.stdout.readline().strip() == "up"
        run = tmp_path / "run"
        code, err = _launch([*TINY, "--steps", "3", "--ckpt-every", "3", "--nproc", "2", "--replica-groups", "2",
                             "--lighthouse", f"127.0.0.1:{port}", "--out", str(run)],
                            PYTHONPATH=str(Path(__file__).parents[1]))
        assert code == 0, err
        assert not any("torchft lighthouse at" in line for line in err), err
        steps = read_metrics(run / "metrics.jsonl")
        assert [row["step"] for row in steps] == [1, 2, 3] and all(row["groups"] == [0, 1] for row in steps), steps
    finally:
        server.kill()
        server.wait()


def test_bad_replica_groups_are_one_line(tmp_path, capsys):
    """R not dividing the processes, the batch not dividing over the groups (or a group's share
    not over its micro-batches), an MoE model and a
    lighthouse nobody listens at: one line each, exit status 2, before any worker starts
    (several machines' bad settings: tests/test_replica_groups_nodes.py)."""
    out = ["--out", str(tmp_path / "r")]
    assert_cli_error([*TINY, "--nproc", "3", "--replica-groups", "2", *out], capsys,
                     "--replica-groups 2 must divide the 3 processes (--nproc) evenly", one_line=False)
    assert_cli_error([*TINY, "--nproc", "4", "--replica-groups", "4", "--global-batch", "6", *out], capsys,
                     "global_batch=6 must divide evenly into 4 replica groups x dp=1 ranks x microbatches=1",
                     one_line=False)  # after the warning that 4 processes share 2 cores
    # Each group's share of the batch (4 / 2 groups = 2 sequences) cannot fill pp=2's default 4 micro-batches.
    assert_cli_error([*TINY, "--nproc", "4", "--replica-groups", "2", "--plan", "pp=2", *out], capsys,
                     "global_batch=4 must divide evenly into 2 replica groups x dp=1 ranks x microbatches=4",
                     one_line=False)
    assert_cli_error([*TINY, "--nproc", "2", "--replica-groups", "2", "--model", "tiny-moe", *out], capsys, "MoE")
    port = free_port()
    assert_cli_error([*TINY, "--nproc", "2", "--replica-groups", "2", "--lighthouse", f"127.0.0.1:{port}", *out], capsys,
                     f"--lighthouse 127.0.0.1:{port}: cannot reach a lighthouse there")
    assert not (tmp_path / "r").exists()
