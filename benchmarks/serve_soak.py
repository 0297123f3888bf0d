"""A soak of `phalanx serve` (127.0.0.1 only, bounded in time): a mixed load of good clients
and bad ones for `--seconds`, then what the server has left.

Clients, each a thread in a loop until the time is up:
- good: greedy completions, half of them streamed (tokens counted);
- bad: bodies the API refuses (malformed JSON, JSON nested 100,000 deep, a lone surrogate,
  service_tier as a list, temperature 1e-300, a body past --max-request-bytes, no API key);
- disconnecting: a stream read for two chunks then hung up, a body cut off half way, and half
  a request header left open (closed by the server after http_limits.HEADER_TIMEOUT_S).

Prints requests answered by kind, answers by HTTP status and error code, every 5xx and
connection failure (the target is none), the server's memory (VmRSS) after the warm-up and
at the end, their ratio (the baseline is the same server after its warm-up, in the same run),
and the KV blocks and running requests left once the load stops (the target is 0: no leak).

    .venv/bin/python benchmarks/serve_soak.py [--seconds 60] [--clients 6] [--json out.json]

Run it on a quiet machine for its memory figure: other processes' load slows the server
(fewer requests in the same time), not its memory per request.
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEY = "soak-key"
LIMIT = 256 << 10
"""Above the deep JSON body (200 KB), so that it reaches the parser."""

BAD_BODIES = {
    "malformed": b"{prompt: 1",
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "surrogate": b'{"prompt": "\\ud800abc", "max_tokens": 1}',
    "tier_list": json.dumps({"prompt": [1], "service_tier": ["priority"]}).encode(),
    "temperature": json.dumps({"prompt": [1], "temperature": 1e-300}).encode(),
    "too_large": json.dumps({"prompt": "a" * (LIMIT + 1)}).encode(),
}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.failures: list[str] = []

    def add(self, key: str, failure: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if failure and len(self.failures) < 20:
                self.failures.append(failure)


def post(url: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + "/v1/completions", data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read()
            return response.status, json.loads(text) if not text.startswith(b"data:") else {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def raw(url: str, data: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(data)
    return sock


def good_client(url: str, seed: int, until: float, tally: Tally) -> None:
    index = 0
    while time.monotonic() < until:
        index += 1
        prompt = [(seed * 7 + index * 13 + i) % 256 for i in range(8 + index % 24)]
        body = {"prompt": prompt, "max_tokens": 4 + index % 28, "temperature": 0, "stream": index % 2 == 0}
        try:
            status, answer = post(url, json.dumps(body).encode())
            kind = "good streamed" if body["stream"] else "good"
            tally.add(f"{kind}: {status}", None if status == 200 else f"{kind} {status}: {answer}")
        except OSError as error:
            tally.add("good: connection failed", repr(error))


def bad_client(url: str, until: float, tally: Tally) -> None:
    kinds = [*BAD_BODIES, "no_key"]
    index = 0
    while time.monotonic() < until:
        kind = kinds[index % len(kinds)]
        index += 1
        try:
            if kind == "no_key":
                status, answer = post(url, json.dumps({"prompt": [1]}).encode(), key=None)
            else:
                status, answer = post(url, BAD_BODIES[kind])
            code = answer.get("error", {}).get("code") if isinstance(answer, dict) else None
            tally.add(f"bad {kind}: {status} {code}", f"bad {kind} {status}: {answer}" if status >= 500 else None)
        except OSError as error:
            tally.add(f"bad {kind}: connection failed", repr(error))


def disconnecting_client(url: str, until: float, tally: Tally, header_timeout_s: float) -> None:
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    index = 0
    held: list[socket.socket] = []
    last_held = time.monotonic()
    while time.monotonic() < until:
        index += 1
        try:
            if index % 3 == 0:  # a stream hung up after two chunks
                body = json.dumps({"prompt": [3] * 16, "max_tokens": 60, "stream": True, "temperature": 0})
                with raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth +
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()) as sock:
                    received = b""
                    while received.count(b"data: ") < 2:
                        piece = sock.recv(4096)
                        if not piece:
                            break
                        received += piece
                tally.add("disconnect mid-stream")
            elif index % 3 == 1:  # a body cut off half way
                raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth +
                    b"Content-Length: 1000\r\n\r\n{\"prompt\": ").close()
                tally.add("disconnect mid-body")
            else:  # half a header, left open
                held.append(raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-"))
                last_held = time.monotonic()
        except OSError as error:
            tally.add("disconnecting: connection failed", repr(error))
        time.sleep(0.2)
    time.sleep(max(0.0, last_held + header_timeout_s + 2 - time.monotonic()))
    closed = 0
    for sock in held:
        sock.settimeout(0)
        try:
            closed += sock.recv(1) == b""
        except BlockingIOError:
            pass
        sock.close()
    with tally.lock:
        tally.counts[f"half headers, of which closed by the server: {closed}"] += len(held)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the load runs (bounded)")
    parser.add_argument("--clients", type=int, default=6, help="good clients (one bad and one disconnecting beside)")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    args = parser.parse_args()
    if not 0 < args.seconds <= 3600:
        parser.error("--seconds must be in (0, 3600]")
    from phalanx.serve.http_limits import HEADER_TIMEOUT_S
    from tests.hf_models import write_checkpoint
    from tests.serve_server import ServeProcess

    with tempfile.TemporaryDirectory() as tmp:
        model = write_checkpoint(Path(tmp) / "llama", "llama", vocab_size=256)
        server = ServeProcess(model, "--api-key", KEY, "--max-request-bytes", str(LIMIT), "--block-size", "8",
                              "--num-kv-blocks", "64", "--max-num-seqs", "8", "--shutdown-grace", "1")
        try:
            tally = Tally()
            good_client(server.url, 0, time.monotonic() + 3, Tally())  # warm-up: first steps, allocator
            warm = rss_kib(server.process.pid)
            until = time.monotonic() + args.seconds
            threads = [threading.Thread(target=good_client, args=(server.url, seed, until, tally))
                       for seed in range(args.clients)]
            threads += [threading.Thread(target=bad_client, args=(server.url, until, tally)),
                        threading.Thread(target=disconnecting_client, args=(server.url, until, tally, HEADER_TIMEOUT_S))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            time.sleep(2)  # the last aborts reach the engine's next step
            end = rss_kib(server.process.pid)
            samples = server.metrics()
        finally:
            server.stop()
    leaked = samples.get("phalanx_kv_blocks_used", -1)
    running = samples.get("phalanx_requests_running", -1)
    errors = [key for key in tally.counts if ": 5" in key or "connection failed" in key]
    figures = {"seconds": args.seconds, "counts": dict(sorted(tally.counts.items())), "rss_warm_kib": warm,
               "rss_end_kib": end, "rss_ratio": end / warm if warm else None, "kv_blocks_left": leaked,
               "requests_running_left": running, "failures": tally.failures}
    for key, count in sorted(tally.counts.items()):
        print(f"  {count:7d}  {key}")
    print(f"memory: {warm / 1024:.1f} MiB after the warm-up, {end / 1024:.1f} MiB at the end: "
          f"{end / warm:.3f}x (target: flat)")
    print(f"left once the load stopped: {leaked:g} KV blocks, {running:g} running requests (target 0)")
    print(f"5xx answers and connection failures: {sum(tally.counts[k] for k in errors)} (target 0)")
    for failure in tally.failures:
        print(f"    {failure[:200]}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
