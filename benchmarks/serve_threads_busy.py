"""`phalanx serve` on a machine whose cores another process is using: its intra-op threads and
OpenMP wait policy as phalanx chooses them (phalanx/threads.py), against the ways that fight
the other process, measured in the same run.

A competing process burns one core the whole time (a pure-Python busy loop; `--pin CPU` pins
it to one CPU, default: wherever the kernel puts it). Beside it, each arm is a fresh
`phalanx serve` (a server that ran the load holds its prompts in the prefix cache) on a small
random llama (serve_load.py's `write_model`), warmed up, then a closed loop of `--concurrency`
requests at a time (default 1 and 4), `--rounds` requests per slot, each generating exactly its
length (`ignore_eos`), answered whole (serve_stream_client.py's lean client). Arms:

- `auto`: phalanx's choice (no OMP_NUM_THREADS, no wait policy in the environment): on the
  2-core machine 1 thread since `phalanx serve` keeps a core for its HTTP threads (2 before
  that), OMP_WAIT_POLICY=PASSIVE;
- `2 active` (the baseline): `--threads 2` and OMP_WAIT_POLICY=ACTIVE, threads that spin while
  they wait for a core the other process holds;
- `2 default`: `--threads 2` and the OpenMP runtime's own default wait (GNU libgomp spins a
  while, then sleeps): what `phalanx serve` ran with before this choice, reached by setting
  KMP_BLOCKTIME (which libgomp ignores), so that phalanx, seeing a wait variable the user
  set, sets none;
- `1 thread`: `--threads 1`;
- `2 fixed` (only when asked): `--threads 2` with phalanx's passive wait: the automatic count
  as it was before it was re-decided while serving (`thread_tuner.py`);
- `2 spin 20k` (only when asked, `--arms`): `--threads 2`, libgomp spinning 20,000 times before it
  sleeps (GOMP_SPINCOUNT; KMP_BLOCKTIME=1 for Intel's runtime, and so that phalanx sets none).

Prints output tokens/s per arm and concurrency, and each arm's ratio to the baseline (`2
active`) and to `1 thread` measured in the same run, with the load average before and after.

    .venv/bin/python benchmarks/serve_threads_busy.py [--concurrency 1,4] [--rounds 3] [--pin 0]

Arms run in the order given by `--arms` (default: 2 active, 2 default, auto, 1 thread), once per
concurrency; `--repeats N` runs them all again in reverse order and keeps each arm's median.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = {
    "2 active": (["--threads", "2"], {"OMP_WAIT_POLICY": "ACTIVE"}),
    "2 default": (["--threads", "2"], {"KMP_BLOCKTIME": "200"}),
    "auto": ([], {}),
    "1 thread": (["--threads", "1"], {}),
    "2 fixed": (["--threads", "2"], {}),
    "2 spin 20k": (["--threads", "2"], {"GOMP_SPINCOUNT": "20000", "KMP_BLOCKTIME": "1"}),
}
BASELINE = "2 active"
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "KMP_BLOCKTIME")


def busy_core(pin: int | None) -> subprocess.Popen:
    """A process that keeps one core busy until killed."""
    code = ("import os, sys\n"
            f"{'' if pin is None else f'os.sched_setaffinity(0, {{{pin}}})'}\n"
            "while True:\n    pass\n")
    return subprocess.Popen([sys.executable, "-c", code])


async def _closed_loop(url: str, name: str, requests, concurrency: int) -> tuple[int, float]:
    from benchmarks.serve_stream_client import completion_tokens

    queue = list(requests)
    done = 0

    async def slot():
        nonlocal done
        while queue:
            prompt, out = queue.pop()
            # Awaited first: `done += await ...` reads `done` before the other slots add theirs.
            tokens = await completion_tokens(url, {"model": name, "prompt": prompt, "max_tokens": out, "temperature": 0,
                                                   "ignore_eos": True})
            done += tokens

    began = time.perf_counter()
    await asyncio.gather(*[slot() for _ in range(concurrency)])
    return done, time.perf_counter() - began


def run_arm(folder: Path, arm: str, requests, concurrency: int) -> tuple[float, str]:
    """Output tokens/s of one fresh server under the closed loop, and the line it said about
    its threads."""
    from tests.serve_server import ServeProcess

    flags, env = ARMS[arm]
    # ServeProcess puts OMP_NUM_THREADS=1 in the server's environment; empty is as good as unset.
    server = ServeProcess(folder, *flags, "--max-num-seqs", str(max(concurrency, 1)), "--num-kv-blocks", "512",
                          env={"OMP_NUM_THREADS": "", **env})
    try:
        asyncio.run(_closed_loop(server.url, server.name, requests[:2], 2))  # warm-up
        tokens, wall = asyncio.run(_closed_loop(server.url, server.name, requests, concurrency))
        said = next((line.strip() for line in server.stderr if "intra-op thread" in line), "(no thread line)")
    finally:
        server.stop()
    assert tokens == sum(out for _, out in requests), "every request generates exactly its length"
    return tokens / wall, said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4", help="requests at once, one closed loop each")
    parser.add_argument("--rounds", type=int, default=3, help="requests per slot of the closed loop")
    parser.add_argument("--arms", default="2 active,2 default,auto,1 thread", help=f"of {', '.join(ARMS)}")
    parser.add_argument("--pin", type=int, default=None, help="pin the competing process to this CPU")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--out", type=int, default=32, help="output tokens per request")
    args = parser.parse_args()
    arms = [arm.strip() for arm in args.arms.split(",")]
    if unknown := [arm for arm in arms if arm not in ARMS]:
        parser.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    for name in WAIT_VARIABLES:  # this shell's own would reach every arm
        os.environ.pop(name, None)
    from benchmarks.serve_load import write_model

    args.moe = False
    rng = random.Random(0)
    load_before = os.getloadavg()[0]
    results: dict[tuple[str, int], list[float]] = {}
    lines: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / "model", args)
        competitor = busy_core(args.pin)
        try:
            for concurrency in [int(c) for c in args.concurrency.split(",")]:
                requests = [([rng.randrange(args.vocab) for _ in range(args.prompt)], args.out)
                            for _ in range(concurrency * args.rounds)]
                for repeat in range(args.repeats):
                    for arm in (arms if repeat % 2 == 0 else arms[::-1]):
                        rate, lines[arm] = run_arm(folder, arm, requests, concurrency)
                        results.setdefault((arm, concurrency), []).append(rate)
                        print(f"  {arm}, concurrency {concurrency}: {rate:.1f} output tokens/s", file=sys.stderr,
                              flush=True)
        finally:
            competitor.kill()
            competitor.wait()
    print(f"llama hidden {args.hidden}, {args.layers} layers, prompts {args.prompt}, outputs {args.out}, "
          f"{args.rounds} requests per slot; one competing busy process "
          f"({'pinned to CPU ' + str(args.pin) if args.pin is not None else 'not pinned'}); "
          f"{len(os.sched_getaffinity(0))} CPUs; load {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    for arm in arms:
        print(f"{arm:>10}: {lines.get(arm, '')}")
    concurrencies = sorted({c for _, c in results})
    print(f"{'arm':>10}" + "".join(f"  c={c}: tok/s  /{BASELINE}  /1 thread" for c in concurrencies))
    for arm in arms:
        row = f"{arm:>10}"
        for c in concurrencies:
            rate = statistics.median(results[(arm, c)])
            base = statistics.median(results[(BASELINE, c)]) if (BASELINE, c) in results else float("nan")
            one = statistics.median(results[("1 thread", c)]) if ("1 thread", c) in results else float("nan")
            row += f"  {rate:11.1f}  {rate / base:9.2f}x  {rate / one:8.2f}x"
        print(row)


if __name__ == "__main__":
    main()
