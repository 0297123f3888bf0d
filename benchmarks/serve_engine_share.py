"""What serving over HTTP in the engine's own process costs (issue 37: "the engine core in its
own process, or an honest measurement showing why not").

The same model, the same requests and the same engine (`phalanx serve`'s own, built by
`serve/cli.build_engine` from the same job) two ways, alternated in fresh processes:
- `engine`: the engine loop alone in a process, a closed loop of `--concurrency` sequences
  stepped back to back, every token detokenized as the server does: what an engine core in a
  process of its own could at most reach if the HTTP side cost it nothing;
- `http`: `phalanx serve`, driven by serve_stream_client.py's lean streaming client (its own
  process) at the same concurrency: the engine thread shares its process (and its GIL) with
  the HTTP server, and the machine's cores with the client.
Prints output tokens/s of each (median of `--rounds`) and http / engine: the share of the
engine's speed that the HTTP side takes. On this 2-core machine a separate engine process
would still share the cores with the HTTP process and the client, so it could win back at
most the difference, and only the GIL's part of it.

    .venv/bin/python benchmarks/serve_engine_share.py [--concurrency 1 8 32] [--hidden 512 --layers 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_aiperf import NAME, VOCAB, write_model  # noqa: E402 (the path above first)

ENGINE_ARM = r"""
import json, sys, time
from phalanx.threads import set_wait_policy
set_wait_policy()  # as phalanx serve does, before torch loads
from phalanx.cli import build_parser
from phalanx.inference.model_source import resolve_model, text_codec
from phalanx.scheduling.scheduler import Sequence
from phalanx.serve.cli import build_engine
from phalanx.serve.detokenize import IncrementalText
from phalanx.serve.job import prepare_job
from phalanx.serve.sampling_params import request_sampling
from phalanx.worker_group import use_threads

model, concurrency, requests, warmup = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
job = prepare_job(build_parser().parse_args(["serve", "--model", model, *sys.argv[5:]]))
use_threads(job.threads)
source = resolve_model(job.model, job.step)
codec = text_codec(source.tokenizer_dir, source.tokenizer)
engine = build_engine(job, source)
scheduler = engine.scheduler
pending = list(enumerate(warmup))  # as the http arm: first calls of every kernel before the clock

def add():
    index, (prompt, out) = pending.pop(0)
    seq = Sequence.of(str(index), prompt, out, params=request_sampling(0, 1, None, 0))
    seq.payload = IncrementalText(codec.decode)
    scheduler.add(seq)

def run():
    global generated
    for _ in range(min(concurrency, len(pending))):
        add()
    while scheduler.has_work():
        for event in engine.step():
            event.seq.payload.add(event.token)
            generated += 1
            if event.finish_reason:
                event.seq.payload.finish()
                if pending:
                    add()

generated = 0
run()
pending = [(len(warmup) + index, request) for index, request in enumerate(requests)]
generated, began = 0, time.perf_counter()
run()
print(generated / (time.perf_counter() - began))
"""


def requests_for(count: int, isl: int, osl: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)  # new prompts per run: no prefix-cache hits
    return [([rng.randrange(1, VOCAB) for _ in range(isl)], osl) for _ in range(count)]


def engine_arm(model: Path, concurrency: int, requests, warmup, flags: list[str]) -> float:
    done = subprocess.run([sys.executable, "-c", ENGINE_ARM, str(model), str(concurrency), json.dumps(requests),
                           json.dumps(warmup), *flags],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if done.returncode != 0:
        sys.exit(f"the engine arm failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


async def _closed_loop(url: str, concurrency: int, requests) -> float:
    from benchmarks.serve_stream_client import stream_times

    queue = list(requests)
    generated = 0

    async def worker():
        nonlocal generated
        while queue:
            prompt, out = queue.pop(0)
            times = await stream_times(url, {"model": NAME, "prompt": prompt, "max_tokens": out, "temperature": 0,
                                             "stream": True, "ignore_eos": True})
            generated += len(times)

    began = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return generated / (time.perf_counter() - began)


def http_arm(model: Path, concurrency: int, requests, warmup, flags: list[str]) -> float:
    from tests.serve_server import ServeProcess

    server = ServeProcess(model, "--served-model-name", NAME, *flags)
    try:
        asyncio.run(_closed_loop(server.url, concurrency, warmup))
        return asyncio.run(_closed_loop(server.url, concurrency, requests))
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=32, help="measured requests per run (at least the concurrency)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--isl", type=int, default=256)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="--threads for both arms (0: phalanx's choice)")
    args = parser.parse_args()
    flags = ["--threads", str(args.threads)] if args.threads else []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model", hidden=args.hidden, layers=args.layers)
        print(f"llama hidden {args.hidden} x {args.layers} layers, fp32, {args.isl} prompt / {args.osl} output tokens, "
              f"greedy, median of {args.rounds} alternated rounds, threads {args.threads or 'automatic'}")
        print("conc  engine alone tok/s  over HTTP tok/s  http/engine")
        for concurrency in args.concurrency:
            count = max(args.requests, concurrency)
            runs: dict[str, list[float]] = {"engine": [], "http": []}
            for round_index in range(args.rounds):
                requests = requests_for(count, args.isl, args.osl, 1000 * round_index + concurrency)
                order = ("engine", "http") if round_index % 2 == 0 else ("http", "engine")
                warmup = requests_for(concurrency, args.isl, 8, 7 + round_index)  # the same for both arms
                for arm in order:
                    if arm == "engine":
                        runs[arm].append(engine_arm(model, concurrency, requests, warmup, flags))
                    else:
                        runs[arm].append(http_arm(model, concurrency, requests, warmup, flags))
            engine, http = statistics.median(runs["engine"]), statistics.median(runs["http"])
            print(f"{concurrency:4d} {engine:19.1f} {http:16.1f} {http / engine:12.2f}", flush=True)


if __name__ == "__main__":
    main()
