"""`phalanx calibrate --serve`'s second half: a real `phalanx serve` on 127.0.0.1 (a free port),
probed with a few streamed requests, for what the engine's steps in-process do not show
(planner/serve/fit.fit_probe): streaming each sequence's token through the server's thread
(per step, per sequence), a tp group's cost per step, the HTTP path per request.

Each request's prompt is `isl` random token ids (no prefix-cache hits) and it streams `osl`
tokens, each in its own event (it asks for log-probabilities); its TTFT is the first token's
arrival after the request was sent, its TPOT the mean gap between the first token and the last. Per server: one warm-up request (a fresh server's
first is slower), three one at a time (their median), and at one process four at once.
benchmarks/serve_planner_local.py probes its servers with the same functions.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from phalanx import hf
from phalanx.layout_rules import tp_problem
from phalanx.planner.serve.fit import ServerProbe, fit_probe
from phalanx.serve.pool_backend import Backend, backend_command
from phalanx.serve.pool_proxy import forward

PROBE_ISL, PROBE_OSL = 64, 16
PROBE_SEQS, PROBE_BUDGET, PROBE_BLOCKS = 32, 512, 256
SEQUENTIAL, BURST = 3, 4


async def stream_one(address: tuple[str, int], name: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds of one streamed greedy completion. It asks for log-probabilities
    (`logprobs: 0`) so that every token comes in an event of its own, with its id: without
    them the server streams text, and random ids' pieces that are not yet whole characters
    wait for the next token's, so fewer events than tokens came and the gaps between events
    read a multiple of the time per token (benchmarks/serve_load.py's client asks the same)."""
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "logprobs": 0}).encode()
    sent = time.perf_counter()
    answer = await forward(address, "POST", "/v1/completions", [("content-type", "application/json")], body)
    times: list[float] = []  # one per token: when the event carrying it arrived
    pending = b""
    async for piece in answer.body:
        now = time.perf_counter()
        pending += piece
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: {"):
                logprobs = json.loads(event[len(b"data: "):])["choices"][0].get("logprobs") or {}
                times += [now] * len(logprobs.get("tokens") or [None])
    if answer.status != 200 or not times:
        raise RuntimeError(f"the probed server answered {answer.status} with {len(times)} tokens: {pending[:200]!r}")
    later = [t for t in times if t > times[0]]  # tokens after the first event's
    return times[0] - sent, (times[-1] - times[0]) / max(1, len(later))


async def probe_running(address: tuple[str, int], name: str, *, tp: int, vocab: int, isl: int = PROBE_ISL,
                        osl: int = PROBE_OSL, max_num_seqs: int = PROBE_SEQS,
                        max_batch_tokens: int = PROBE_BUDGET) -> ServerProbe:
    """The probe's medians on a server already listening at `address` (its flags: `max_num_seqs`
    seats, `max_batch_tokens` budget)."""
    rng = random.Random(99)
    prompt = lambda: [rng.randrange(vocab) for _ in range(isl)]  # noqa: E731
    await stream_one(address, name, prompt(), osl)  # warm-up
    one = [await stream_one(address, name, prompt(), osl) for _ in range(SEQUENTIAL)]
    burst = BURST if tp == 1 else 0
    together = await asyncio.gather(*(stream_one(address, name, prompt(), osl) for _ in range(burst)))
    return ServerProbe(tp=tp, isl=isl, osl=osl, max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens,
                       ttft_s=statistics.median(t for t, _ in one), tpot_s=statistics.median(p for _, p in one),
                       burst=burst, burst_tpot_s=statistics.median(p for _, p in together) if together else 0.0)


async def probe_server(folder, *, tp: int, vocab: int, env: dict[str, str] | None = None, log=print) -> ServerProbe:
    """Start `phalanx serve --model folder` over `tp` processes with the probe's flags, probe it,
    stop it (SIGTERM, as an operator would)."""
    flags = ["--model", str(folder), "--num-kv-blocks", str(PROBE_BLOCKS), "--block-size", "16",
             "--max-num-batched-tokens", str(PROBE_BUDGET), "--max-num-seqs", str(PROBE_SEQS)]
    backend = Backend(f"probe tp={tp}", backend_command(flags, f"tp={tp}", tp), env or {})
    began = time.perf_counter()
    try:
        address = await backend.start()
        log(f"  server of {tp} process{'es' * (tp > 1)} up in {time.perf_counter() - began:.1f} s on port {address[1]}")
        probe = await probe_running(address, str(folder), tp=tp, vocab=vocab)
    finally:
        await backend.stop()
    burst = f", {probe.burst} at once: TPOT {probe.burst_tpot_s * 1e3:.1f} ms" if probe.burst else ""
    log(f"  through the server, {tp} process{'es' * (tp > 1)}: one at a time TTFT {probe.ttft_s * 1e3:.1f} ms, "
        f"TPOT {probe.tpot_s * 1e3:.1f} ms{burst}")
    return probe


def probe_model_folder(cfg, folder):
    """`folder` with a randomly initialized model of `cfg`'s shape in Hugging Face form (what
    `phalanx serve` reads; the costs probed depend on the shape, not the weights)."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch

    from phalanx.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg).float().eval()
    return hf.save(model, folder)


def group_sizes(cfg, max_procs: int) -> list[int]:
    """The tp groups probed: 2, 4, ... up to `max_procs`, those the model's shape splits into."""
    return [g for g in (2, 4, 8) if g <= max_procs and not tp_problem(
        g, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, ffn_dim=cfg.ffn_dim, vocab_size=cfg.vocab_size,
        expert_ffn_dim=cfg.moe_ffn_dim, n_experts=cfg.n_experts)]


def probe_and_fit(cfg, cluster, costs, *, max_procs: int, folder=None, env: dict[str, str] | None = None,
                  log=print):
    """`costs` refitted by probing a server of one process, then one per tp group size; and
    the probes. Without `folder` a random model of `cfg`'s shape is written for the servers."""
    probes = []
    with tempfile.TemporaryDirectory(prefix="phalanx-serve-probe-") as scratch:
        if folder is None:
            folder = probe_model_folder(cfg, Path(scratch) / "model")
        for tp in [1, *group_sizes(cfg, max_procs)]:  # one process first: the group's cost is beyond its step's
            probe = asyncio.run(probe_server(folder, tp=tp, vocab=cfg.vocab_size, env=env, log=log))
            costs = fit_probe(cfg, cluster, costs, probe)
            probes.append(probe)
    return costs, probes
