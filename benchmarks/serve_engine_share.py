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

Where the engine thread's time goes, from the kernel's own accounting of that thread
(/proc/PID/task/TID/schedstat: time on a core, time runnable but waiting for one; the rest of
the wall time it was blocked): `cpu` on a core, `queue` waiting for a core (the cores' part),
`blocked` asleep. Alone, the engine thread blocks only where its OpenMP team's barrier sleeps
(passive policy); over HTTP it also blocks waiting for the GIL that the server's threads hold
and, between requests, for work. So `blocked` over HTTP minus `blocked` alone bounds the GIL's
share from above: what an engine in a process of its own could win back at most on a machine
with cores to spare (where `queue` is zero). `http ms/tok` is the CPU the server's other
threads spent per output token (uvicorn, the streamed events), `client ms/tok` the client's.
The server's engine thread is found by its OS name (`phalanx-engine`, engine_loop.py).

`--pin` (with `--threads 1`) gives each arm's engine thread core 0 to itself and puts
everything else (the server's other threads, the client) on core 1: a machine with cores to
spare, as a GPU host is. Then `queue` is about zero and `blocked` over HTTP is the GIL's
share (plus waits for work), which a separate engine process would win back. It adds a third
arm, `busy other`: the engine alone on core 0 beside a process that only spins on core 1 (an
integer loop: no memory traffic to speak of), which shows what the other core's work costs the
engine thread's own steps where they share a physical core (two vCPUs of one core) or more.

    .venv/bin/python benchmarks/serve_engine_share.py [--concurrency 1 8 32] [--hidden 512 --layers 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
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
import json, sys, threading, time
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
def schedstat():
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as file:
        return [int(x) for x in file.read().split()[:2]]

generated, began, before = 0, time.perf_counter(), schedstat()
run()
wall, after = time.perf_counter() - began, schedstat()
print(json.dumps({"tok_s": generated / wall, "wall_s": wall, "cpu_s": (after[0] - before[0]) / 1e9,
                  "queue_s": (after[1] - before[1]) / 1e9, "http_cpu_s": 0.0, "client_cpu_s": 0.0,
                  "tokens": generated}))
"""


def requests_for(count: int, isl: int, osl: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)  # new prompts per run: no prefix-cache hits
    return [([rng.randrange(1, VOCAB) for _ in range(isl)], osl) for _ in range(count)]


ENGINE_CORE, OTHERS_CORE = 0, 1
"""`--pin`: the engine thread's core, and the core of everything else."""


def engine_arm(model: Path, concurrency: int, requests, warmup, flags: list[str], pin: bool) -> dict:
    pinned = (lambda: os.sched_setaffinity(0, {ENGINE_CORE})) if pin else None  # one thread: the engine's
    done = subprocess.run([sys.executable, "-c", ENGINE_ARM, str(model), str(concurrency), json.dumps(requests),
                           json.dumps(warmup), *flags],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], preexec_fn=pinned)
    if done.returncode != 0:
        sys.exit(f"the engine arm failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    return generated / (time.perf_counter() - began), generated


def _tasks(pid: int) -> dict[str, tuple[int, int, int]]:
    """{thread name (its id after a '/'): (ns on a core, ns waiting for one, CPU ticks)} of every
    thread of process `pid`."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            on_core, queued = (int(x) for x in (task / "schedstat").read_text().split()[:2])
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        out[f"{name}/{task.name}"] = (on_core, queued, int(fields[11]) + int(fields[12]))  # utime + stime
    return out


def _spin() -> None:
    """`--pin`'s busy-other arm: a process that keeps OTHERS_CORE busy and touches no memory."""
    os.sched_setaffinity(0, {OTHERS_CORE})
    count = 0
    while True:
        count += 1


def busy_other_arm(model: Path, concurrency: int, requests, warmup, flags: list[str]) -> dict:
    """The engine alone on ENGINE_CORE while a spinning process holds OTHERS_CORE."""
    spinner = multiprocessing.Process(target=_spin, daemon=True)
    spinner.start()
    try:
        return engine_arm(model, concurrency, requests, warmup, flags, pin=True)
    finally:
        spinner.kill()
        spinner.join()


def _pin_server(pid: int) -> None:
    """`--pin`: the engine thread alone on ENGINE_CORE; the server's other threads, and this
    process (the client), on OTHERS_CORE (threads started later inherit their creator's)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        core = ENGINE_CORE if (task / "comm").read_text().strip() == "phalanx-engine" else OTHERS_CORE
        os.sched_setaffinity(int(task.name), {core})
    os.sched_setaffinity(0, {OTHERS_CORE})


def http_arm(model: Path, concurrency: int, requests, warmup, flags: list[str], pin: bool) -> dict:
    from tests.serve_server import ServeProcess

    # As a user runs it: its own thread count from the cores (the tests' harness would pin one).
    server = ServeProcess(model, "--served-model-name", NAME, *flags, one_thread=False)
    cores = os.sched_getaffinity(0)
    try:
        if pin:
            _pin_server(server.process.pid)
        asyncio.run(_closed_loop(server.url, concurrency, warmup))
        before, client_before, began = _tasks(server.process.pid), time.process_time(), time.perf_counter()
        tok_s, tokens = asyncio.run(_closed_loop(server.url, concurrency, requests))
        wall, after, client_cpu = time.perf_counter() - began, _tasks(server.process.pid), time.process_time() - client_before
    finally:
        server.stop()
        os.sched_setaffinity(0, cores)  # the next arm's processes inherit this process's cores
    # Threads take their creator's name: the engine's OpenMP workers, started by the engine
    # thread after it was named, are named as it is; the engine thread is the first of them.
    named = sorted((key for key in after if key.startswith("phalanx-engine/")), key=lambda key: int(key.split("/")[1]))
    if not named:
        sys.exit(f"no thread named phalanx-engine in the server: {sorted(after)}")
    engine, tick = named[0], os.sysconf("SC_CLK_TCK")
    http_ticks = sum(after[key][2] - before.get(key, (0, 0, 0))[2] for key in after if key not in named)
    (cpu_after, queue_after, _), (cpu_before, queue_before, _) = after[engine], before[engine]
    return {"tok_s": tok_s, "wall_s": wall, "cpu_s": (cpu_after - cpu_before) / 1e9,
            "queue_s": (queue_after - queue_before) / 1e9, "http_cpu_s": http_ticks / tick,
            "client_cpu_s": client_cpu, "tokens": tokens}


def _time_shares(runs: list[dict]) -> str:
    """The engine thread's wall time over the rounds, in % on a core / waiting for one / asleep."""
    wall = sum(run["wall_s"] for run in runs)
    cpu, queued = (100 * sum(run[key] for run in runs) / wall for key in ("cpu_s", "queue_s"))
    return f"{cpu:.0f}/{queued:.0f}/{100 - cpu - queued:.0f}"


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
    parser.add_argument("--pin", action="store_true", help="the engine thread on a core of its own, the rest on "
                        "another (needs --threads 1 and cores 0 and 1)")
    args = parser.parse_args()
    if args.pin and (args.threads != 1 or not {ENGINE_CORE, OTHERS_CORE} <= os.sched_getaffinity(0)):
        parser.error("--pin needs --threads 1 and cores 0 and 1 in this process's affinity")
    flags = ["--threads", str(args.threads)] if args.threads else []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model", hidden=args.hidden, layers=args.layers)
        print(f"llama hidden {args.hidden} x {args.layers} layers, fp32, {args.isl} prompt / {args.osl} output tokens, "
              f"greedy, median of {args.rounds} alternated rounds, threads {args.threads or 'automatic'}"
              + (f", engine thread alone on core {ENGINE_CORE}, the rest on core {OTHERS_CORE}" if args.pin else ""))
        print("conc  engine alone tok/s  over HTTP tok/s  http/engine  engine thread cpu/queue/blocked % "
              "(alone | over HTTP)  http ms/tok  client ms/tok")
        for concurrency in args.concurrency:
            count = max(args.requests, concurrency)
            arms = ("engine", "http", "busy") if args.pin else ("engine", "http")
            runs: dict[str, list[dict]] = {arm: [] for arm in arms}
            for round_index in range(args.rounds):
                requests = requests_for(count, args.isl, args.osl, 1000 * round_index + concurrency)
                order = arms if round_index % 2 == 0 else arms[::-1]
                warmup = requests_for(concurrency, args.isl, 8, 7 + round_index)  # the same for every arm
                for arm in order:
                    if arm == "engine":
                        runs[arm].append(engine_arm(model, concurrency, requests, warmup, flags, args.pin))
                    elif arm == "http":
                        runs[arm].append(http_arm(model, concurrency, requests, warmup, flags, args.pin))
                    else:
                        runs[arm].append(busy_other_arm(model, concurrency, requests, warmup, flags))
            engine, http = (statistics.median(run["tok_s"] for run in runs[arm]) for arm in ("engine", "http"))
            shares = " | ".join(_time_shares(runs[arm]) for arm in ("engine", "http"))
            per_token = {side: 1000 * sum(run[f"{side}_cpu_s"] for run in runs["http"]) /
                         sum(run["tokens"] for run in runs["http"]) for side in ("http", "client")}
            busy = (f"  busy other {statistics.median(run['tok_s'] for run in runs['busy']) / engine:.2f}x of alone"
                    if args.pin else "")
            print(f"{concurrency:4d} {engine:19.1f} {http:16.1f} {http / engine:12.2f}  {shares:>40}  "
                  f"{per_token['http']:11.3f}  {per_token['client']:13.3f}{busy}", flush=True)


if __name__ == "__main__":
    main()
