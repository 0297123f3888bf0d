"""Load on `phalanx serve` through HTTP, against `transformers` on the same model and the same
requests, measured in the same run.

Requests are seeded: prompts of 16-256 random token ids, outputs of 16-128 tokens (each
generates exactly its length: no end-of-text). phalanx: a real `phalanx serve` process, each
request streamed over HTTP (logprobs=0, so every token is its own chunk and timed; a lean h11
client, `serve_stream_client.py`, so that the load takes little of the CPU it measures), in
- a closed loop: all `--concurrency` requests at once (the comparison below), run `--repeats`
  times (default 3), each on a fresh server (a server that ran it holds its prompts in the
  prefix cache); the run of median throughput is compared, since on the 2-core VM of
  2026-12-02 consecutive 3-second runs of the same code moved by 10-30%; and
- open loops: seeded Poisson arrivals at each of `--rates` requests/s.
Baselines, in this process, on the same weights and requests, all arriving at once:
(a) `transformers` generating them one after another; (b) one static left-padded batch
through `transformers.generate` (to the longest output; the bound without scheduling);
(c) `transformers`' continuous batching (`generate_batch`) with phalanx's block size, block
count and token budget (its default cache sizing is several times slower on CPU).

Prints per arm: output tokens/s, TTFT and TPOT p50/p99, goodput (requests/s meeting TTFT <=
--slo-ttft and TPOT <= --slo-tpot), then phalanx's throughput ratios against (a), (b), (c).

    .venv/bin/python benchmarks/serve_load.py [--moe] [--device cuda] [--threads 1] [--tp 2] [--repeats 3]

`--tp N` serves with `--nproc N --plan tp=N` (the baselines stay one process). `--unstreamed`
also runs the closed loop with every request answered whole (no event per token), on a fresh
server, and prints streamed / unstreamed throughput: what per-token streaming costs the engine.

`--slo`: the latency targets instead (`phalanx serve --ttft-ms/--tpot-ms`, docs/serve.md): the
same seeded Poisson load at `--slo-rate` through two servers, one without targets and one with
`--ttft-ms` = --slo-ttft and `--tpot-ms` = --slo-tpot. Prints per arm TPOT p50/p99, the share of
served requests within the TPOT target, refusals (429 at arrival), attainment (requests within
both targets, over all sent) and goodput, then goodput with targets / without.

    .venv/bin/python benchmarks/serve_load.py --slo [--slo-rate 6] [--slo-tpot 0.1] [--slo-ttft 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_model(folder: Path, args) -> Path:
    import transformers

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.heads // 2, max_position_embeddings=512)
    if args.moe:
        config = transformers.MixtralConfig(**common, intermediate_size=args.hidden, num_local_experts=8,
                                            num_experts_per_tok=2)
    else:
        config = transformers.LlamaConfig(**common, intermediate_size=4 * args.hidden)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # O(1) logits
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    return folder


def make_requests(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    (low, high), (out_low, out_high) = ((16, 32), (4, 8)) if args.quick else ((16, 256), (16, 128))
    return [([rng.randrange(args.vocab) for _ in range(rng.randint(low, high))], rng.randint(out_low, out_high))
            for _ in range(args.requests)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


def summary(name: str, outputs: list[int], wall: float, ttft: list[float] | None, tpot: list[float] | None, args) -> dict:
    print(f"  {name}: {wall:.1f} s", file=sys.stderr, flush=True)  # progress
    row = {"arm": name, "output_tokens_per_s": sum(outputs) / wall, "wall_s": wall}
    if ttft is not None:
        met = sum(1 for a, b in zip(ttft, tpot) if a <= args.slo_ttft and b <= args.slo_tpot)
        row.update(ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99), tpot_p50=percentile(tpot, 50),
                   tpot_p99=percentile(tpot, 99), goodput_req_per_s=met / wall)
    return row


# phalanx through HTTP ---------------------------------------------------------------------

async def _one(url: str, name: str, prompt, out, start_at, began) -> tuple[float, float, int]:
    from benchmarks.serve_stream_client import Refused, stream_times

    await asyncio.sleep(max(0.0, start_at - (time.perf_counter() - began)))
    sent = time.perf_counter()
    try:
        times = await stream_times(url, {"model": name, "prompt": prompt, "max_tokens": out, "temperature": 0,
                                         "stream": True, "logprobs": 0})
    except Refused:  # refused at arrival (--ttft-ms admission)
        return float("inf"), float("inf"), 0
    ttft = times[0] - sent
    tpot = (times[-1] - times[0]) / max(1, len(times) - 1)
    return ttft, tpot, len(times)


async def _unstreamed(url: str, name: str, requests) -> tuple[list[int], float]:
    """All requests at once, each answered whole (no per-token events): the tokens, the wall."""
    from benchmarks.serve_stream_client import completion_tokens

    began = time.perf_counter()
    outputs = await asyncio.gather(*[completion_tokens(url, {"model": name, "prompt": prompt, "max_tokens": out,
                                                             "temperature": 0}) for prompt, out in requests])
    return list(outputs), time.perf_counter() - began


def fresh_closed_loop(folder: Path, requests, args) -> dict:
    """The closed loop again on a server of its own (a server that ran it holds its prompts in
    the prefix cache), after the same warm-up."""
    server = start_server(folder, args)
    try:
        phalanx_arm("warm-up", server, requests[:2], [0.0, 0.0], args)
        return phalanx_arm(f"phalanx serve, closed loop of {args.concurrency}", server, requests,
                           [0.0] * len(requests), args)
    finally:
        server.stop()


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput (the lower middle of an even count)."""
    return sorted(runs, key=lambda row: row["output_tokens_per_s"])[(len(runs) - 1) // 2]


def unstreamed_arm(folder: Path, requests, args) -> dict:
    """The closed loop unstreamed, on a server of its own (the streamed arm's server holds the
    same prompts in its prefix cache), after the same warm-up."""
    server = start_server(folder, args)
    try:
        phalanx_arm("warm-up", server, requests[:2], [0.0, 0.0], args)
        outputs, wall = asyncio.run(_unstreamed(server.url, server.name, requests))
    finally:
        server.stop()
    assert outputs == [o for _, o in requests], "every request generates exactly its length"
    return summary(f"phalanx serve, closed loop of {args.concurrency}, unstreamed", outputs, wall, None, None, args)


async def _drive(url: str, name: str, requests, arrivals: list[float]):
    began = time.perf_counter()
    results = await asyncio.gather(*[_one(url, name, p, o, at, began) for (p, o), at in zip(requests, arrivals)])
    return results, time.perf_counter() - began


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds so far of a process and its living descendants (under
    `--tp` the server's ranks are its launcher's children; Linux /proc; nan elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
    except OSError:
        return float("nan")
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(process_cpu_s(child) for child in children)


def phalanx_arm(name: str, server, requests, arrivals, args) -> dict:
    server_cpu, client_cpu = process_cpu_s(server.process.pid), time.process_time()
    results, wall = asyncio.run(_drive(server.url, server.name, requests, arrivals))
    server_cpu, client_cpu = process_cpu_s(server.process.pid) - server_cpu, time.process_time() - client_cpu
    outputs = [n for _, _, n in results]
    assert outputs == [o for _, o in requests], "every request generates exactly its length"
    row = summary(name, outputs, wall, [r[0] for r in results], [r[1] for r in results], args)
    row.update(server_cpu_s=server_cpu, client_cpu_s=client_cpu)
    return row


def start_server(folder: Path, args, *extra: str):
    from tests.serve_server import ServeProcess

    tp = ["--nproc", str(args.tp), "--plan", f"tp={args.tp}"] if args.tp > 1 else []
    return ServeProcess(folder, *extra, *tp, "--block-size", str(args.block_size), "--num-kv-blocks", str(args.num_kv_blocks),
                        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs",
                        str(args.concurrency), "--device", args.device,
                        env={"OMP_NUM_THREADS": str(args.threads)} if args.threads else {"OMP_NUM_THREADS": ""})


# transformers baselines --------------------------------------------------------------------

class TokenTimes:
    """A generate() streamer that times each new token (the first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.calls = 0

    def put(self, value):
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self):
        pass


def load_hf(folder: Path, device):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def sequential_arm(model, requests, device, args) -> dict:
    began, ttft, tpot, outputs = time.perf_counter(), [], [], []
    for prompt, out in requests:
        ids = torch.tensor([prompt], device=device)
        streamer = TokenTimes()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=out,
                       min_new_tokens=out, streamer=streamer)
        ttft.append(streamer.times[0] - began)  # all arrived at the start
        tpot.append((streamer.times[-1] - streamer.times[0]) / max(1, len(streamer.times) - 1))
        outputs.append(len(streamer.times))
    return summary("(a) transformers one after another", outputs, time.perf_counter() - began, ttft, tpot, args)


@torch.no_grad()
def static_batch_arm(model, requests, device, args) -> dict:
    longest = max(len(p) for p, _ in requests)
    ids = torch.zeros(len(requests), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(requests):  # left padding
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    began = time.perf_counter()
    new = max(o for _, o in requests)
    model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=new, min_new_tokens=new)
    # Each request's useful tokens are its own length; the batch computed all to the longest.
    return summary("(b) transformers static padded batch", [o for _, o in requests], time.perf_counter() - began,
                   None, None, args)


@torch.no_grad()
def continuous_arm(model, requests, args) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in requests), eos_token_id=None,
                              pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=args.block_size, num_blocks=args.num_kv_blocks,
                                        max_batch_tokens=args.max_num_batched_tokens,
                                        max_requests_per_batch=args.concurrency)
    # One call per output length, all started together, is not possible: every request here
    # generates the longest length and its own first `out` tokens are counted and timed.
    began = time.perf_counter()
    results = model.generate_batch([p for p, _ in requests], generation_config=config,
                                   continuous_batching_config=batching, record_timestamps=True)
    wall = time.perf_counter() - began
    by_prompt = {tuple(r.prompt_ids): r for r in results.values()}
    ttft, tpot = [], []
    for prompt, out in requests:
        stamps = by_prompt[tuple(prompt)].timestamps[:out]
        ttft.append(stamps[0] - began)
        tpot.append((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))
    return summary("(c) transformers generate_batch (same blocks, budget)", [o for _, o in requests], wall, ttft, tpot, args)


def show(rows: list[dict]) -> None:
    print(f"{'arm':58} {'out tok/s':>9} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} {'goodput':>8}")
    for row in rows:
        times = "".join(f" {row[k]:>{w}.3f}" if k in row else f" {'-':>{w}}" for k, w in
                        (("ttft_p50", 9), ("ttft_p99", 7), ("tpot_p50", 9), ("tpot_p99", 7), ("goodput_req_per_s", 8)))
        print(f"{row['arm']:58} {row['output_tokens_per_s']:>9.1f}{times}")


def poisson(count: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    arrivals, at = [], 0.0
    for _ in range(count):
        arrivals.append(at)
        at += rng.expovariate(rate)
    return arrivals


def slo_arm(name: str, server, requests, arrivals, args) -> dict:
    results, wall = asyncio.run(_drive(server.url, server.name, requests, arrivals))
    served = [r for r in results if r[2]]
    ttft, tpot = [r[0] for r in served], [r[1] for r in served]
    row = summary(name, [r[2] for r in served], wall, ttft, tpot, args)
    row["refused"] = len(results) - len(served)
    row["tpot_within"] = sum(t <= args.slo_tpot for t in tpot) / max(1, len(served))
    row["attained"] = sum(a <= args.slo_ttft and b <= args.slo_tpot for a, b in zip(ttft, tpot)) / len(results)
    return row


def slo_main(args, requests) -> None:
    arrivals = poisson(len(requests), args.slo_rate, args.seed + 1)
    targets = ("--ttft-ms", f"{args.slo_ttft * 1000:g}", "--tpot-ms", f"{args.slo_tpot * 1000:g}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / "model", args)
        for name, extra in (("phalanx serve, no targets", ()), ("phalanx serve " + " ".join(targets), targets)):
            server = start_server(folder, args, *extra)
            try:
                phalanx_arm("warm-up", server, requests[:2], [0.0, 0.0], args)
                rows.append(slo_arm(name, server, requests, arrivals, args))
            finally:
                server.stop()
    print(f"llama hidden {args.hidden}, {args.layers} layers, {args.requests} requests at Poisson {args.slo_rate:g} req/s "
          f"(seed {args.seed}), device {args.device}, threads {args.threads or 'default'}, load {os.getloadavg()[0]:.1f}; "
          f"targets TTFT {args.slo_ttft} s, TPOT {args.slo_tpot * 1000:g} ms")
    print(f"{'arm':44} {'out tok/s':>9} {'TPOT p50':>9} {'p99':>7} {'TPOT ok':>8} {'refused':>8} {'attained':>9} {'goodput':>8}")
    for row in rows:
        print(f"{row['arm']:44} {row['output_tokens_per_s']:>9.1f} {row['tpot_p50']:>9.3f} {row['tpot_p99']:>7.3f} "
              f"{row['tpot_within']:>8.0%} {row['refused']:>8} {row['attained']:>9.0%} {row['goodput_req_per_s']:>8.2f}")
    base = rows[0]["goodput_req_per_s"]
    print(f"goodput with targets / without: {rows[1]['goodput_req_per_s'] / base:.2f}x" if base else
          f"goodput without targets is 0; with them {rows[1]['goodput_req_per_s']:.2f} req/s")
    if unstreamed is not None:
        print(f"{unstreamed['arm']}: {unstreamed['output_tokens_per_s']:.1f} output tokens/s; streamed / unstreamed "
              f"{ours / unstreamed['output_tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="serve with --nproc N --plan tp=N (the baselines stay one process)")
    parser.add_argument("--moe", action="store_true", help="a small mixtral (8 experts, top 2) instead of the llama")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32, help="closed loop: requests at once (and --max-num-seqs)")
    parser.add_argument("--rates", default="1,2,4", help="open loops: Poisson arrival rates, requests/s")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on every side (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--repeats", type=int, default=3,
                        help="closed loops, each on a fresh server (a server that ran it holds its prompts in the prefix "
                             "cache); the median run is compared (3-second runs here drift 10-30%% one to the next)")
    parser.add_argument("--unstreamed", action="store_true",
                        help="also the closed loop answered whole, on a server of its own: what streaming each token costs")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run that tests the script, not the engine (device_check.sh --dry-run): a 2-layer "
                             "hidden-64 llama, 4 requests at once, prompts 16-32, outputs 4-8, no open loops")
    parser.add_argument("--slo", action="store_true", help="the latency-target comparison instead (see above)")
    parser.add_argument("--slo-rate", type=float, default=6.0, help="--slo: Poisson arrivals, requests/s")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.heads, args.vocab, args.requests, args.concurrency, args.rates = 64, 2, 4, 512, 4, 4, ""
        args.repeats = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    requests = make_requests(args)
    if args.slo:
        return slo_main(args, requests)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / "model", args)
        server = start_server(folder, args)
        try:
            phalanx_arm("warm-up", server, requests[:2], [0.0, 0.0], args)
            closed = [phalanx_arm(f"phalanx serve, closed loop of {args.concurrency}", server, requests,
                                  [0.0] * len(requests), args)]
            for rate in [float(r) for r in args.rates.split(",") if r]:
                arrivals = poisson(len(requests), rate, args.seed + 1)
                rows.append(phalanx_arm(f"phalanx serve, Poisson {rate:g} req/s", server, requests, arrivals, args))
        finally:
            server.stop()
        closed += [fresh_closed_loop(folder, requests, args) for _ in range(args.repeats - 1)]
        rows.insert(0, median_run(closed))
        unstreamed = unstreamed_arm(folder, requests, args) if args.unstreamed else None
        model = load_hf(folder, device)
        rows.append(sequential_arm(model, requests, device, args))
        rows.append(static_batch_arm(model, requests, device, args))
        rows.append(continuous_arm(model, requests, args))
    print(f"{'mixtral 8x2' if args.moe else 'llama'} hidden {args.hidden}, {args.layers} layers, {args.requests} requests "
          f"(prompts {'16-32' if args.quick else '16-256'}, outputs {'4-8' if args.quick else '16-128'}, seed {args.seed}), device {args.device}, threads {args.threads or 'default'}, "
          f"{f'phalanx tp={args.tp}, ' if args.tp > 1 else ''}load {os.getloadavg()[0]:.1f}; SLO TTFT {args.slo_ttft} s, TPOT {args.slo_tpot * 1000:g} ms")
    show(rows)
    if len(closed) > 1:
        each = ", ".join(f"{row['output_tokens_per_s']:.1f}" for row in closed)
        print(f"closed loop on {len(closed)} servers: {each} output tokens/s; the table's row and the ratios below "
              "are the median run's")
    print(f"closed loop: {rows[0]['wall_s']:.1f} s wall; CPU of the server process (engine and HTTP) "
          f"{rows[0]['server_cpu_s']:.1f} s, of the client {rows[0]['client_cpu_s']:.1f} s (2 cores shared)")
    ours = rows[0]["output_tokens_per_s"]
    for row in rows[-3:]:
        print(f"phalanx closed loop / {row['arm'][:3]}: throughput {ours / row['output_tokens_per_s']:.2f}x"
              + (f", TTFT p99 {rows[0]['ttft_p99']:.3f} s against {row['ttft_p99']:.3f} s" if "ttft_p99" in row else ""))
    if unstreamed is not None:
        print(f"{unstreamed['arm']}: {unstreamed['output_tokens_per_s']:.1f} output tokens/s; streamed / unstreamed "
              f"{ours / unstreamed['output_tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
