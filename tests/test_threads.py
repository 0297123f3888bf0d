"""Intra-op threads and the OpenMP wait policy (phalanx/threads.py): the count from the cores a
process may use and the local ranks, the user's environment kept, `--threads` parsed and bad
values refused, and a real `phalanx serve --threads 1` on the count it was given. No timing:
benchmarks/serve_threads_busy.py measures what the choice is for."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx import threads
from phalanx.cli import build_parser
from phalanx.testing.cli_errors import assert_cli_error
from phalanx.threads import PASSIVE, choose_threads, physical_cores, set_wait_policy
from tests.hf_models import write_checkpoint


@pytest.mark.parametrize("cores, ranks, expected", [
    (8, 1, 8), (8, 2, 4), (8, 3, 2),  # what is left over is not handed out: 3 x 2 <= 8
    (2, 1, 2), (2, 2, 1), (2, 4, 1),  # more ranks than cores: each still gets one
    (1, 1, 1), (4, 0, 4),  # 0 ranks (a malformed LOCAL_WORLD_SIZE) counts as one
])
def test_count_is_cores_over_local_ranks(cores, ranks, expected):
    choice = choose_threads(cores=cores, local_ranks=ranks, environ={})
    assert choice.threads == expected
    assert f"{cores} cores in this process's affinity" in choice.why


@pytest.mark.parametrize("cores, ranks, expected", [
    (2, 1, 1), (16, 1, 15), (16, 2, 7),  # a server keeps one core for its HTTP threads
    (2, 2, 1), (1, 1, 1),  # never below one thread, nor the reserve above the cores
])
def test_a_server_keeps_a_core_for_its_other_threads(cores, ranks, expected):
    choice = choose_threads(cores=cores, local_ranks=ranks, environ={}, reserved=threads.SERVER_RESERVED_CORES)
    assert choice.threads == expected and choice.automatic
    assert ("1 kept for the server's other threads" in choice.why) == (cores > 1)
    requested = choose_threads(requested=2, cores=cores, local_ranks=ranks, environ={}, reserved=1)
    assert requested.threads == 2, "--threads is kept as given"


def test_requested_count_wins_over_cores_and_environment():
    choice = choose_threads(requested=3, cores=2, local_ranks=2, environ={"OMP_NUM_THREADS": "1"})
    assert (choice.threads, choice.why) == (3, "--threads 3")


@pytest.mark.parametrize("value, expected", [("5", 5), ("4,2", 4), (" 1 ", 1), ("", 3), ("0", 3), ("many", 3)])
def test_users_omp_num_threads_is_kept(value, expected):
    """A count the user set is used as it is (the first of a nested list); an empty, zero or
    unreadable one is as good as unset (the OpenMP runtime ignores it too)."""
    choice = choose_threads(cores=6, local_ranks=2, environ={"OMP_NUM_THREADS": value})
    assert choice.threads == expected
    assert ("OMP_NUM_THREADS" in choice.why) == (expected != 3)


def test_this_process_divides_its_affinity_among_local_ranks(monkeypatch):
    monkeypatch.setattr(threads, "affinity", lambda: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(threads, "physical_cores", len)
    choice = threads.choose_for_this_process(environ={"LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "6"})
    assert choice.threads == 2 and "3 local ranks" in choice.why


def test_hyperthreads_of_one_core_count_once(tmp_path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 0), (0, 1), (0, 1), (1, 0)]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert physical_cores({0, 1, 2, 3, 4}, tmp_path) == 3
    assert physical_cores({0, 2}, tmp_path) == 2
    assert physical_cores({0, 1, 7}, tmp_path) == 3  # cpu7 unknown to /sys: every CPU counts


def test_wait_policy_is_passive_unless_the_user_chose():
    environ: dict[str, str] = {}
    assert set_wait_policy(environ) == PASSIVE and environ == PASSIVE
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"KMP_BLOCKTIME": "200"}):
        environ = dict(chosen)
        assert set_wait_policy(environ) == {} and environ == chosen


def test_the_line_says_count_policy_and_why():
    line = choose_threads(cores=2, local_ranks=1, environ={"OMP_WAIT_POLICY": "PASSIVE"}).line(2)
    assert line.startswith("phalanx: 2 intra-op threads per process (2 cores in this process's affinity / 1 local rank)")
    assert "OpenMP wait policy PASSIVE" in line
    assert "ACTIVE (OMP_WAIT_POLICY in the environment)" in choose_threads(
        cores=2, local_ranks=1, environ={"OMP_WAIT_POLICY": "ACTIVE"}).line(2)


def test_use_threads_sets_torch(monkeypatch):
    import torch

    from phalanx.worker_group import use_threads

    monkeypatch.setattr(threads, "affinity", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "physical_cores", len)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    before = use_threads(0)
    try:
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("verb", [["serve", "--model", "m"], ["train"], ["generate", "--model", "m", "--prompt", "x"]])
def test_threads_flag_is_parsed(verb):
    assert build_parser().parse_args([*verb, "--threads", "3"]).threads == 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("threads") / "llama", "llama")


@pytest.mark.parametrize("verb, message", [
    (["serve"], "--threads must be >= 0"),
    (["generate", "--prompt", "x"], "--threads must be >= 0"),
])
def test_negative_threads_refused(verb, message, model, capsys):
    assert_cli_error([verb[0], "--model", str(model), *verb[1:], "--threads", "-1"], capsys, message)


def test_negative_threads_refused_by_train(capsys, tmp_path):
    assert_cli_error(["train", "--model", "tiny", "--threads", "-2", "--out", str(tmp_path / "r")], capsys,
                     "--threads must be >= 0")


def test_serve_runs_on_the_threads_given(model, monkeypatch):
    """A real server: --threads 1 is what its torch runs on, though the environment leaves
    OMP_NUM_THREADS unset, and its OpenMP runtime started with the passive wait policy (libgomp
    says what it read when OMP_DISPLAY_ENV is set: the policy was in place before torch loaded)."""
    from tests.serve_server import ServeProcess

    for name in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    server = ServeProcess(model, "--threads", "1", env={"OMP_NUM_THREADS": "", "OMP_DISPLAY_ENV": "TRUE"})
    try:
        said = [line for line in server.stderr if "intra-op thread" in line]
        assert len(said) == 1, server.stderr
        assert said[0].startswith("phalanx: 1 intra-op thread per process (--threads 1); OpenMP wait policy PASSIVE"), said
        runtime = [line.strip() for line in server.stderr if "OMP_WAIT_POLICY" in line]
        assert runtime and set(runtime) == {"OMP_WAIT_POLICY = 'PASSIVE'"}, server.stderr
        # The engine's thread carries its name in the operating system (what top -H shows).
        names = [task.joinpath("comm").read_text().strip() for task in Path(f"/proc/{server.process.pid}/task").iterdir()]
        assert names.count("phalanx-engine") == 1, names
    finally:
        server.stop()
