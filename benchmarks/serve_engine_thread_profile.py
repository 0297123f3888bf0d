"""Where a serving engine thread's time goes behind HTTP, by sampling (issue 37: what an engine
core in a process of its own would take off that thread).

`phalanx serve` (one thread, serve_aiperf's llama) with its engine thread alone on core 0 and
its other threads and the client on core 1 (serve_engine_share.py's `--pin`), driven by the
same closed loop at `--concurrency`; py-spy (a tool nobody here wrote, in a venv of its own:
`pip install py-spy`) samples the server's threads meanwhile. Prints the engine thread's busy
samples by what they were in: the model's forward, the sampler, the scheduler, and the loop's
own work around a step (detokenizing, the pieces handed to the HTTP handlers, /metrics), each
as a share of the thread's busy samples; its samples waiting for work are counted apart.
What lies outside `Engine.step` is what an engine process would move to the HTTP process.

    .venv/bin/python benchmarks/serve_engine_thread_profile.py --py-spy /work/venvs/pyspy/bin/py-spy
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_aiperf import NAME, write_model  # noqa: E402 (the path above first)
from benchmarks.serve_engine_share import OTHERS_CORE, _closed_loop, _pin_server, requests_for  # noqa: E402

LOOP_FRAME = "EngineLoop._run (phalanx/serve/engine_loop.py"
STEP_FRAME = "EngineLoop._step (phalanx/serve/engine_loop.py"


def engine_share(raw: str) -> tuple[Counter, int]:
    """py-spy's raw (collapsed) stacks -> (busy samples of the engine thread by part, samples
    it waited for work)."""
    parts, idle = Counter(), 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if LOOP_FRAME not in stack:
            continue
        at = next((i for i, frame in enumerate(frames) if frame.startswith(STEP_FRAME)), None)
        if at is None:
            if any(frame.startswith("Condition.wait") for frame in frames):
                idle += int(count)
            else:
                parts["loop: between steps"] += int(count)
            continue
        below = [frame.split(" (")[0] for frame in frames[at + 1:]]
        if below[:1] == ["Engine.step"]:
            inner = below[2] if len(below) > 2 and below[1] == "Engine._run" else (below[1] if len(below) > 1 else "")
            name = {"ModelRunner.run_message": "model forward", "StepSampler.sample": "sampler",
                    "Scheduler.schedule": "scheduler"}.get(inner, f"step: {inner or 'Engine.step'}")
        else:
            name = f"loop: {below[0] if below else 'EngineLoop._step'}"
        parts[name] += int(count)
    return parts, idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--py-spy", required=True, help="the py-spy executable")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=int, default=15, help="how long py-spy samples (the load outlasts it)")
    args = parser.parse_args()
    from tests.serve_server import ServeProcess

    cores = os.sched_getaffinity(0)
    if not {0, OTHERS_CORE} <= cores:
        parser.error("needs cores 0 and 1")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model")
        server = ServeProcess(model, "--served-model-name", NAME, "--threads", "1", one_thread=False)
        try:
            _pin_server(server.process.pid)
            asyncio.run(_closed_loop(server.url, args.concurrency, requests_for(args.concurrency, 256, 8, 7)))
            out = Path(tmp) / "stacks.txt"
            spy = subprocess.Popen([args.py_spy, "record", "-p", str(server.process.pid), "--threads", "--idle",
                                    "-r", "200", "-d", str(args.seconds), "-f", "raw", "-o", str(out), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            # Enough requests that the loop outlasts the sampling: 128 tokens each, ~1000 tokens/s here.
            count = max(2 * args.concurrency, 8 * args.seconds)
            asyncio.run(_closed_loop(server.url, args.concurrency, requests_for(count, 256, 128, 11)))
            if spy.wait() != 0:
                sys.exit(f"py-spy failed: {spy.stderr.read()[-2000:]}")
        finally:
            server.stop()
            os.sched_setaffinity(0, cores)
        parts, idle = engine_share(out.read_text())
    busy = sum(parts.values())
    print(f"phalanx serve, llama hidden 512 x 4 layers, 1 thread, concurrency {args.concurrency}, engine thread alone on "
          f"core 0; py-spy at 200 samples/s for {args.seconds} s: {busy} busy samples of the engine thread "
          f"({idle} more waiting for work)")
    for name, count in parts.most_common():
        print(f"  {100 * count / busy:5.1f}%  {name}")


if __name__ == "__main__":
    main()
