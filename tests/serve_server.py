"""A real `phalanx serve` process on 127.0.0.1 for the HTTP tests, and the reference they
compare with: `transformers`' greedy generation, with the near-tie rule.

fp32 kernels differ with the batch shape (a one-row matmul and a 32-row one part by ~1e-5), so
a served greedy continuation may leave the reference's only where the reference's two most
likely tokens are within NEAR_TIE of each other; anywhere else the ids must be equal.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

NEAR_TIE = 1e-3
START_TIMEOUT_S = 240


ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""The server's torch on one thread: on a machine shared by many processes, two OpenMP threads
that spin at every barrier made a tiny model's steps many times slower. A benchmark that
measures phalanx as a user runs it passes `one_thread=False`: the server then chooses its own
count (and re-decides it while serving) from the cores, as it does outside the tests."""


class ServeProcess:
    def __init__(self, model: Path, *flags: str, env: dict | None = None, one_thread: bool = True):
        command = [sys.executable, "-m", "phalanx", "serve", "--model", str(model), "--port", "0", *flags]
        base = dict(os.environ) if one_thread else {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**base, **(ONE_THREAD if one_thread else {}), **(env or {})},
                                        start_new_session=True)  # stop() ends its workers too
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.process.stdout, self.lines.put, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, self.stderr.append), daemon=True).start()
        try:
            line = self.lines.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            line = None
        if not line:  # None: nothing in time; "": the server exited first (no waiting for the timeout)
            self.stop()
            why = f"exit {self.process.returncode}" if line == "" else f"nothing printed in {START_TIMEOUT_S} s"
            raise RuntimeError(f"phalanx serve did not start ({why}): {''.join(self.stderr)}")
        prefix = "phalanx: serving "
        assert line.startswith(prefix) and " on http://127.0.0.1:" in line, line
        self.name = line[len(prefix):line.rindex(" on http://")]
        self.url = line.strip().rsplit(" on ", 1)[1]
        self.wait_healthy()

    @staticmethod
    def _read(stream, put, say_end: bool = False) -> None:
        for line in stream:
            put(line)
        if say_end:
            put("")  # the stream closed: the process has exited

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:  # nothing listens (a multi-rank server restarting its ranks)
            return 0

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.status("/health") != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"phalanx serve never became healthy: {''.join(self.stderr)}")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """The samples of /metrics, keyed by name with labels ('x_total{rank="0"}')."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def post(self, path: str, body) -> tuple[int, dict]:
        """(status, JSON answer) of POSTing `body` as JSON to `path`, errors included."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def client(self, api_key: str = "none"):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def rank_pids(self) -> dict[int, int]:
        """{0: the worker that listens on the server's port, 1: ...the other workers} of a
        `--nproc N` server (its launcher's children; rank 0 is the one holding the socket)."""
        port = int(self.url.rsplit(":", 1)[1])
        listening = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    listening.add(f"socket:[{fields[9]}]")
        children = sorted(int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat")
                          if _parent(stat) == self.process.pid)
        def holds(pid: int) -> bool:
            try:
                return any(os.readlink(fd) in listening for fd in Path(f"/proc/{pid}/fd").iterdir())
            except OSError:
                return False
        rank0 = [pid for pid in children if holds(pid)]
        others = [pid for pid in children if pid not in rank0]
        return {rank: pid for rank, pid in enumerate(rank0 + others)}

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def stop(self) -> None:
        """Kill the server and any workers it started (its process group)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(30)


def _parent(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def transformers_greedy(folder: Path, prompts: list[list[int]], new: int) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's greedy continuation by `transformers` (no end-of-text stop: the tiny
    checkpoints have no tokenizer), with the logits of every step."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            # An explicit mask: transformers would otherwise mask out prompt ids equal to pad_token_id.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                 output_logits=True, return_dict_in_generate=True)
            results.append((out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()))
    return results


def assert_greedy_equal(ours: list[int], reference: list[int], logits: torch.Tensor) -> None:
    """Equal token for token, or first different at a near-tie of the reference's top-2 logits."""
    for step, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            top = logits[step].topk(2).values
            gap = float(top[0] - top[1])
            assert gap < NEAR_TIE, f"step {step}: served {a}, transformers {b}, top-2 logits apart by {gap:.2e}"
            return
    assert len(ours) == len(reference)
