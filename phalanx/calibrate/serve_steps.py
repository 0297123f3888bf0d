"""`phalanx calibrate --serve`: time `phalanx serve`'s own engine steps on this machine and fit
the serving planner's engine constants (planner/serve/fit.py), written to `serve-local.json`
beside the cluster file (planner/serve/costs.py reads it for `--cluster local`).

The steps are the engine's (phalanx/serve/engine.py: the scheduler's batch through the
model and its paged cache, sampling included), in this process, on a randomly initialized
model of the shape asked for: decode steps of 1 to 16 sequences at two contexts, and prompt
steps of 16 to 256 tokens alone, each the fastest of a few repeats after a warm-up (on a
shared machine the fastest is the least disturbed). Then a real `phalanx serve` of that shape
(the model directory itself, when --model is one with weights) is probed through HTTP for what
the steps do not show (serve_probe.py): one process, then each tp group up to --max-procs.
About a minute and a half for the `small` preset on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

from phalanx.planner.hardware import cluster_from_name
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.serve.fit import MeasuredStep, compute_world, fit
from phalanx.planner.serve.step import ServeLayout
from phalanx.scheduling.scheduler import Chunk, Scheduler, Sequence, Step


def _engine(cfg, *, num_blocks: int, block_size: int, max_tokens: int):
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch

    from phalanx.model.transformer import Transformer
    from phalanx.serve.engine import Engine

    torch.manual_seed(0)
    model = Transformer(cfg).float().eval()
    scheduler = Scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=64,
                          max_num_batched_tokens=max_tokens, max_waiting=10**6)
    return Engine(model, scheduler, "cpu")


def _add(engine, n: int, prompt_len: int, max_tokens: int, tag: str) -> None:
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.serve.sampling_params import request_sampling

    rng = random.Random(tag)  # distinct prompts: no prefix-cache hits
    for i in range(n):
        prompt = [rng.randrange(engine.model.cfg.vocab_size) for _ in range(prompt_len)]
        seq = Sequence.of(f"{tag}{i}", prompt, max_tokens, params=request_sampling(0.0, 1.0, None, 0))
        engine.scheduler.add(seq)


def _timed_step(engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def measure(cfg, *, repeats: int = 5, log=print) -> list[MeasuredStep]:
    """Decode steps at batches 1, 4, 16 and contexts 32, 192; prompt steps of 16, 64, 256."""
    steps: list[MeasuredStep] = []
    for batch in (1, 4, 16):
        for context in (32, 192):
            engine = _engine(cfg, num_blocks=batch * (context // 16 + 4) + 8, block_size=16, max_tokens=4096)
            _add(engine, batch, context, 2 + repeats + 1, "d")
            engine.step()  # the prompts
            engine.step()  # warm-up decode
            times = [_timed_step(engine) for _ in range(repeats)]
            steps.append(MeasuredStep(batch, context + 2 + repeats / 2, 0, 0.0, min(times)))
            log(f"  decode: {batch} sequences at context {context}: {steps[-1].seconds * 1e3:.2f} ms")
    for tokens in (16, 64, 256):
        engine = _engine(cfg, num_blocks=(tokens // 16 + 2) * (repeats + 1) + 8, block_size=16, max_tokens=tokens)
        _add(engine, 1, tokens, 1, "w")
        engine.step()  # warm-up
        times = []
        for r in range(repeats):
            _add(engine, 1, tokens, 1, f"p{r}-")
            times.append(_timed_step(engine))
        steps.append(MeasuredStep(0, 0.0, tokens, tokens / 2, min(times)))
        log(f"  prompt: {tokens} tokens: {steps[-1].seconds * 1e3:.2f} ms")
    return steps


def engine_splits_forwards() -> bool:
    """Whether `phalanx serve`'s engine runs a step of one decode and one prompt chunk as two
    forwards (serve/input_batch.step_forwards, asked with such a step; `ServeCosts.split_forwards`)."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.serve.input_batch import step_forwards

    decoding = Sequence.of("decoding", [1, 2], 4)
    decoding.num_computed = 1
    prompt = Sequence.of("prompt", [3, 4, 5], 4)
    forwards, _ = step_forwards(Step([Chunk(decoding, 1, 1), Chunk(prompt, 0, 3)], []))
    return len(forwards) > 1


def calibrate_serve(model_name: str, out_path, *, max_procs: int = 2, log=print) -> dict:
    """Engine steps in this process, then a real server (serve_probe.py); the constants written
    to `out_path`."""
    # Imported when run, not at the top: it brings in h11, torch, which start-up need not wait for.
    import torch

    from phalanx.calibrate.serve_probe import probe_and_fit
    from phalanx.hf.weights import has_any_weights

    cfg = model_from_name(model_name)
    cluster = cluster_from_name("local")
    log(f"timing phalanx serve's engine steps of {cfg.name} on this CPU ({torch.get_num_threads()} threads)")
    steps = measure(cfg, log=log)
    costs, error = fit(cfg, cluster, steps, ServeLayout(weight_dtype="fp32", kv_dtype="fp32"),
                       split_forwards=engine_splits_forwards(), world=compute_world(cluster, 1, torch.get_num_threads()))
    log("probing a real phalanx serve on 127.0.0.1 (HTTP, streaming, tp groups)")
    folder = model_name if Path(model_name).is_dir() and has_any_weights(Path(model_name)) else None
    costs, probes = probe_and_fit(cfg, cluster, costs, max_procs=max_procs, folder=folder, log=log)
    record = {**dataclasses.asdict(costs),
              "source": f"phalanx calibrate --serve --model {model_name}: {len(steps)} engine steps, "
                        f"fit median error {error:.1%}, {torch.get_num_threads()} threads; a server probed at "
                        + ", ".join(f"tp={p.tp}" for p in probes)}
    write_serve_costs(record, out_path)
    fitted = {k: v for k, v in dataclasses.asdict(costs).items() if isinstance(v, float)}
    log(f"fit: {', '.join(f'{k}={v:.3g}' for k, v in fitted.items())}, group_step_s={list(costs.group_step_s)}; "
        f"engine steps' median error {error:.1%}")
    log(f"wrote {out_path}")
    return record


def write_serve_costs(record: dict, out_path) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(record, indent=2) + "\n")
