"""`phalanx serve` against vLLM's own CPU build on the same checkpoint, the same load and the
same client, measured in the same run (issue 37's comparison).

The checkpoint is a random llama (`--hidden`, `--layers`; default serve_aiperf.py's hidden 512,
4 layers; `--hidden 768 --layers 12` is the ~100M model of issue 37) served in fp32 (`--dtype
bf16`: both in bfloat16, for CPUs with bf16 instructions) with a word-level
tokenizer. The client is NVIDIA's AIPerf for both servers (nobody here wrote it; issue 37 allows
"your own client, the same for both"): streamed completions of `--isl` prompt tokens and exactly
`--osl` output tokens (`ignore_eos`), a closed loop at each `--concurrency`, prompts drawn with
a new seed for every run so that neither server's prefix cache holds them. Each server is
started once per round and measured at every concurrency, then stopped; rounds alternate
phalanx-vLLM and vLLM-phalanx (`--rounds`, default 2), so a drifting machine hits both. Prints
per concurrency each server's median output tokens/s over the rounds, TTFT and ITL p50/p99, and
phalanx / vLLM, with the versions; `--contention` adds a competing busy process on one core for
the whole run; `--phalanx-flags` passes more flags to `phalanx serve` (e.g. "--threads 1").

    benchmarks/setup_vllm_venv.sh /work/venvs/vllm     # once
    .venv/bin/python benchmarks/serve_vs_vllm.py --vllm-python /work/venvs/vllm/bin/python \\
        --aiperf /work/venvs/aiperf/bin/aiperf [--concurrency 1 8 32] [--contention]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_aiperf import NAME, run_aiperf, write_model  # noqa: E402 (the path above first)

VLLM_START_S = 300


VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def start_vllm(python: str, model: Path, port: int, log: Path, dtype: str) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}  # 1 GiB of KV cache, as phalanx serve's CPU default
    process = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                "--served-model-name", NAME, "--port", str(port), "--dtype", VLLM_DTYPES[dtype],
                                "--max-model-len", "1024"], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                               env=env, start_new_session=True)
    deadline = time.monotonic() + VLLM_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"vLLM exited at start-up; its log: {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return process
        except OSError:
            time.sleep(2)
    process.kill()
    sys.exit(f"vLLM did not answer in {VLLM_START_S} s; its log: {log}")


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, 15)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)


def busy() -> None:
    os.sched_setaffinity(0, {0})
    while True:
        pass


def measure(arm: str, args, model: Path, folder: Path, round_index: int) -> dict[int, dict]:
    """{concurrency: AIPerf's figures} for one server started for this round."""
    from tests.serve_server import ServeProcess

    if arm == "phalanx":
        # As a user runs it: its own thread count from the cores (the tests' harness would pin one).
        server = ServeProcess(model, "--served-model-name", NAME, "--dtype", args.dtype, *args.phalanx_flags.split(),
                              one_thread=False)
        url, stopper = server.url, server.stop
        said = next((line.strip() for line in server.stderr if "intra-op thread" in line), "(no thread line)")
        print(f"  round {round_index} {said}", file=sys.stderr, flush=True)
    else:
        process = start_vllm(args.vllm_python, model, args.vllm_port, folder / f"vllm{round_index}.log", args.dtype)
        url, stopper = f"http://127.0.0.1:{args.vllm_port}", lambda: stop(process)
    try:
        out = {}
        for concurrency in args.concurrency:
            args.seed = 1000 * round_index + concurrency  # new prompts every run: no prefix-cache hits
            out[concurrency] = run_aiperf(args.aiperf, url, model, concurrency, args,
                                          folder / f"{arm}-r{round_index}-c{concurrency}")
            print(f"  round {round_index} {arm} concurrency {concurrency}: "
                  f"{out[concurrency]['output_token_throughput']['avg']:.1f} tokens/s", file=sys.stderr, flush=True)
        return out
    finally:
        stopper()
        if arm == "phalanx":  # the counts the server switched to while serving (thread_tuner.py)
            for line in server.stderr:
                if line.startswith("phalanx: intra-op threads "):
                    print(f"  round {round_index} {line.strip()}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="python of the venv setup_vllm_venv.sh made")
    parser.add_argument("--aiperf", required=True, help="the aiperf executable (a venv of its own)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16, help="measured requests per run (at least the concurrency)")
    parser.add_argument("--isl", type=int, default=256)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vllm-port", type=int, default=8011)
    parser.add_argument("--dtype", choices=sorted(VLLM_DTYPES), default="fp32", help="both servers' weights and cache")
    parser.add_argument("--contention", action="store_true", help="a busy process on core 0 for the whole run")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    parser.add_argument("--phalanx-flags", default="", metavar="FLAGS",
                        help="more flags for phalanx serve, e.g. \"--threads 1\" (printed with the table)")
    args = parser.parse_args()
    version = subprocess.run([args.vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True).stdout.strip()
    competitor = multiprocessing.Process(target=busy, daemon=True) if args.contention else None
    if competitor:
        competitor.start()
    runs: dict[str, dict[int, list[dict]]] = {"phalanx": {}, "vllm": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = write_model(Path(tmp) / "model", hidden=args.hidden, layers=args.layers)
            for round_index in range(args.rounds):
                order = ("phalanx", "vllm") if round_index % 2 == 0 else ("vllm", "phalanx")
                for arm in order:
                    for concurrency, figures in measure(arm, args, model, Path(tmp), round_index).items():
                        runs[arm].setdefault(concurrency, []).append(figures)
    finally:
        if competitor:
            competitor.kill()
    rows = []
    print(f"phalanx serve vs vLLM {version} (CPU build), {args.dtype}, llama hidden {args.hidden} x {args.layers} layers, "
          f"{args.isl} prompt / {args.osl} output tokens, AIPerf, median of {args.rounds} alternated rounds"
          f"{', a busy process on core 0' if args.contention else ''}"
          f"{f', phalanx serve {args.phalanx_flags}' if args.phalanx_flags else ''}")
    print("conc  phalanx tok/s  vLLM tok/s  phalanx/vLLM  TTFT p50 ph/vLLM ms  TTFT p99 ph/vLLM ms  ITL p50 ph/vLLM ms  ITL p99 ph/vLLM ms")
    for concurrency in args.concurrency:
        med = {arm: {key: statistics.median(f[key][stat] for f in runs[arm][concurrency])
                     for key, stat in (("output_token_throughput", "avg"), ("time_to_first_token", "p50"),
                                       ("inter_token_latency", "p50"))}
               for arm in runs}
        p99 = {arm: {key: statistics.median(f[key]["p99"] for f in runs[arm][concurrency])
                     for key in ("time_to_first_token", "inter_token_latency")} for arm in runs}
        ph, vl = med["phalanx"], med["vllm"]
        row = {"concurrency": concurrency, "phalanx": {**ph, **{k + "_p99": v for k, v in p99["phalanx"].items()}},
               "vllm": {**vl, **{k + "_p99": v for k, v in p99["vllm"].items()}},
               "ratio": ph["output_token_throughput"] / vl["output_token_throughput"]}
        rows.append(row)
        print(f"{concurrency:4d} {ph['output_token_throughput']:14.1f} {vl['output_token_throughput']:11.1f} "
              f"{row['ratio']:12.2f}  {ph['time_to_first_token']:8.1f}/{vl['time_to_first_token']:<8.1f}"
              f"   {p99['phalanx']['time_to_first_token']:8.1f}/{p99['vllm']['time_to_first_token']:<8.1f}"
              f"   {ph['inter_token_latency']:6.1f}/{vl['inter_token_latency']:<6.1f}"
              f"      {p99['phalanx']['inter_token_latency']:6.1f}/{p99['vllm']['inter_token_latency']:<6.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
