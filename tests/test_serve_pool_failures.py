"""A `--pool` instance that dies is noticed: SIGKILL to one instance's process while a stream
runs on it. The stream ends with a clear error (no 500, no traceback in the front's log), the
front's /health turns 503 within seconds naming the instance, its class is answered 503 with
why while the other class is served, and the front starts the instance again, which answers
as `transformers` does (greedy, near-tie rule of tests/serve_server.py)."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.hf_models import VOCAB, write_checkpoint
from tests.serve_server import ServeProcess, assert_greedy_equal, transformers_greedy

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
NEW = 8


def _health(server) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _instances(front_pid: int) -> list[int]:
    """The front's child processes that are `phalanx serve` instances."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == front_pid:
                if b"serve" in (stat.parent / "cmdline").read_bytes():
                    found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(found)


def _complete(server, prompt, tier: str):
    return server.client().completions.create(model=server.name, prompt=prompt, max_tokens=NEW, temperature=0,
                                              extra_body={"return_token_ids": True},
                                              extra_headers={"X-Phalanx-Class": tier}).choices[0].token_ids


def test_a_dead_instance_is_noticed_answered_and_restarted(tmp_path):
    folder = write_checkpoint(tmp_path / "llama", "llama")
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    server = ServeProcess(folder, "--pool", "latency:tp=1", "--pool", "throughput:tp=1", "--block-size", "8",
                          "--shutdown-grace", "1", "--max-restarts", "1")
    try:
        first = _complete(server, prompt, "throughput")
        victim = _instances(server.process.pid)[-1]
        stream = server.client().completions.create(model=server.name, prompt=prompt, max_tokens=100, temperature=0,
                                                    stream=True)
        next(iter(stream))
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        try:
            for _ in stream:
                pass
            ended = "done"
        except openai.APIError as error:
            ended = str(error)
        while _health(server)[0] == 200 and time.monotonic() - killed < 30:
            time.sleep(0.05)
        noticed, (status, body) = time.monotonic() - killed, _health(server)
        log = "".join(server.stderr)
        dead = re.search(r"pool (\w+)'s instance \d+ \(tp=1\) was killed by signal SIGKILL; restarting it", log)
        assert dead, log
        other = {"latency": "throughput", "throughput": "latency"}[dead.group(1)]
        served = _complete(server, prompt, other)
        try:
            refused = _complete(server, prompt, dead.group(1))
        except openai.APIStatusError as error:
            refused = error
        deadline = time.monotonic() + 240
        while _health(server)[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        again = _complete(server, prompt, dead.group(1))
    finally:
        server.stop()
    assert noticed < 5, noticed
    assert status == 503 and "SIGKILL" in body
    assert ended == "done" or "stopped answering" in ended or "restarting" in ended, ended
    if not isinstance(refused, list):  # unless the restart won the race
        assert refused.status_code == 503 and "restarting it" in str(refused), refused
    assert "Traceback" not in "".join(server.stderr)
    reference, logits = transformers_greedy(folder, [prompt], NEW)[0]
    for answer in (first, served, again):
        assert_greedy_equal(answer, reference, logits)


def test_the_key_reaches_instances_in_their_environment_not_their_command_line():
    """`ps` shows every user a command line: the front passes the key in the environment."""
    from phalanx.cli import build_parser
    from phalanx.serve.pool_main import instance_flags

    args = build_parser().parse_args(["serve", "--model", "m", "--pool", "a:tp=1", "--api-key", "s3cret",
                                      "--max-num-seqs", "4"])
    flags = instance_flags(args, args.serve_parser)
    assert flags == ["--model", "m", "--max-num-seqs", "4"] and "s3cret" not in flags


def test_sigterm_while_the_instances_start_is_a_stop(tmp_path):
    """SIGTERM before the pools are up: the instances are stopped, no error, exit 0, and no
    serving line was printed (it comes only once every pool is up)."""
    import subprocess
    import sys

    folder = write_checkpoint(tmp_path / "llama", "llama")
    front = subprocess.Popen([sys.executable, "-m", "phalanx", "serve", "--model", str(folder), "--port", "0",
                              "--pool", "latency:tp=1", "--pool", "throughput:tp=1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while len(_instances(front.pid)) < 2 and time.monotonic() < deadline:  # both instances started
            time.sleep(0.1)
        front.send_signal(signal.SIGTERM)
        out, err = front.communicate(timeout=120)
    finally:
        try:
            os.killpg(front.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert front.returncode == 0, err
    assert "serving" not in out and "error" not in err, (out, err)
