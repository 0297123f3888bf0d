"""A multi-rank `phalanx serve` that stays up: it idles longer than its collective timeout and
keeps answering (heartbeats, phalanx/launch/rank_loop.py), and a rank killed while requests run is noticed
within seconds: every client gets its answer or a clear error, /health stops saying 200, and
the launcher restarts the ranks, which serve again (phalanx/launch/worker_launch.py's restart policy).

The collective timeout is set short (2 s) so that the idle wait is three times it. The greedy
answers are compared with `transformers` under the near-tie rule of tests/serve_server.py
(tensor and expert parallelism sum in another order, ~1e-6), before and after the restart."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.hf_models import VOCAB, write_checkpoint
from tests.serve_server import ServeProcess, assert_greedy_equal, transformers_greedy

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

TIMEOUT_S = 2
NOTICED_WITHIN_S = 5.0
"""A dead rank breaks the next collective at once (gloo: the peer's socket closes); the idle
heartbeat comes at most every TIMEOUT_S / 4. Five seconds leave room for a loaded machine."""


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
            for n in torch.randint(4, 20, (count,), generator=generator)]


def _greedy(server: ServeProcess, prompts: list[list[int]], new: int) -> list[list[int]]:
    client = server.client()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = pool.map(lambda p: client.completions.create(model=server.name, prompt=p, max_tokens=new, temperature=0,
                                                               extra_body={"return_token_ids": True}), prompts)
        return [answer.choices[0].token_ids for answer in answers]


def _health(server: ServeProcess) -> int | None:
    """/health's status, None while nothing listens."""
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def _check_equal(folder, prompts, answers, new):
    for answer, (reference, logits) in zip(answers, transformers_greedy(folder, prompts, new)):
        assert_greedy_equal(answer, reference, logits)


def _kill_while_streaming(server: ServeProcess, rank: int) -> tuple[list[str], float]:
    """Four streams in flight (each has its first piece), then SIGKILL to `rank`: what each
    client got ("done" or its error's message), and the seconds until /health stopped saying 200."""
    client = server.client()
    started = threading.Barrier(5)
    outcomes: list[str] = []

    def stream(prompt):
        try:
            pieces = client.completions.create(model=server.name, prompt=prompt, max_tokens=100, temperature=0,
                                               stream=True)
            first = True
            for _ in pieces:
                if first:
                    started.wait(60)
                    first = False
            outcomes.append("done")
        except openai.APIError as error:
            outcomes.append(str(error))

    threads = [threading.Thread(target=stream, args=(p,)) for p in _prompts(4, 7)]
    for thread in threads:
        thread.start()
    started.wait(60)
    os.kill(server.rank_pids()[rank], signal.SIGKILL)
    killed = time.monotonic()
    while _health(server) == 200 and time.monotonic() - killed < 30:
        time.sleep(0.05)
    noticed = time.monotonic() - killed
    for thread in threads:
        thread.join(60)
    return outcomes, noticed


def test_tp2_idles_past_its_collective_timeout_and_restarts_after_a_rank_dies(tmp_path):
    folder = write_checkpoint(tmp_path / "llama", "llama")
    prompts, new = _prompts(8, 2), 8
    server = ServeProcess(folder, "--nproc", "2", "--plan", "tp=2", "--block-size", "8", "--shutdown-grace", "1",
                         "--collective-timeout", str(TIMEOUT_S), "--max-restarts", "1")
    try:
        before = _greedy(server, prompts[:1], new)
        time.sleep(3 * TIMEOUT_S)  # idle: without heartbeats rank 1's wait would time out here
        idle = _greedy(server, prompts, new)
        outcomes, noticed = _kill_while_streaming(server, rank=1)
        server.wait_healthy()  # the restarted ranks
        after = _greedy(server, prompts, new)
        server.signal(signal.SIGTERM)
        assert server.process.wait(120) == 0
    finally:
        server.stop()
    assert noticed < NOTICED_WITHIN_S, noticed
    assert len(outcomes) == 4
    for outcome in outcomes:  # in flight when the rank died: a clear error (or, if it won the race, its answer)
        assert outcome == "done" or "a rank of this server failed" in outcome, outcome
    stderr = "".join(server.stderr)
    assert "rank 1 of the server exited with signal SIGKILL; restarting the server's ranks (restart 1 of 1)" in stderr
    assert "Traceback" not in stderr
    _check_equal(folder, prompts, before + idle[1:], new)
    assert idle[0] == before[0]
    _check_equal(folder, prompts, after, new)


def test_dp2_ep2_idles_past_its_collective_timeout_and_restarts_after_rank0_dies(tmp_path):
    folder = write_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    prompts, new = _prompts(8, 3), 8
    server = ServeProcess(folder, "--nproc", "2", "--plan", "dp=2,ep=2", "--block-size", "8", "--shutdown-grace", "1",
                          "--collective-timeout", str(TIMEOUT_S), "--max-restarts", "1")
    try:
        _greedy(server, prompts[:2], new)
        time.sleep(3 * TIMEOUT_S)
        idle = _greedy(server, prompts, new)
        os.kill(server.rank_pids()[0], signal.SIGKILL)
        killed = time.monotonic()
        while _health(server) == 200 and time.monotonic() - killed < 30:
            time.sleep(0.05)
        noticed = time.monotonic() - killed
        server.wait_healthy()
        after = _greedy(server, prompts, new)
    finally:
        server.stop()
    assert noticed < NOTICED_WITHIN_S, noticed
    assert "rank 0 of the server exited with signal SIGKILL; restarting" in "".join(server.stderr)
    _check_equal(folder, prompts, idle, new)
    _check_equal(folder, prompts, after, new)
