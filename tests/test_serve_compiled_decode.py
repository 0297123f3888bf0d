"""`phalanx serve --compile` (serve/compiled_decode.py): decodes through one compiled graph give
the eager engine's logits, at a batch of one (padded to two) and of several, with a one-token
prompt among them; and a model the compiled step does not cover says why and stays eager.

Tolerance 1e-4 on fp32 logits of size O(1) (tests/hf_models.py): inductor fuses the norms,
rotary and SiLU into its own loops and multiplies through oneDNN on packed weights, so sums run
in another order (~1e-6 apart on these models); a wrong slot, position or rotary row moves the
logits by O(0.1) (test_serve_engine.py).
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
import torch

import phalanx.hf as hf
from phalanx.cpu_ops import decode_kernel
from phalanx.cpu_ops.onednn_linear import use_onednn
from phalanx.scheduling.scheduler import Scheduler, Sequence
from phalanx.serve.engine import Engine
from phalanx.serve.sampling_params import request_sampling
from tests.hf_models import VOCAB, write_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not decode_kernel.usable(torch.device("cpu"), torch.float32),
                                reason="the compiled step reads the pool with the C decode kernel: no C compiler here")
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _load(tmp_path_factory, family: str):
    model = hf.load(write_checkpoint(tmp_path_factory.mktemp(family) / "hf", family))
    use_onednn(model)  # as `phalanx serve` loads it on CPU
    return model


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model, prompts: dict[str, list[int]], compile: bool) -> tuple[dict[str, torch.Tensor], Engine]:
    """Greedy through the engine, one sequence at first, then more: each one's logits per token."""
    seen: dict[str, list[torch.Tensor]] = defaultdict(list)
    scheduler = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_waiting=16)
    engine = Engine(model, scheduler, on_logits=lambda seq, row: seen[seq.seq_id].append(row.clone()), compile=compile)
    names = list(prompts)
    scheduler.add(Sequence.of(names[0], prompts[names[0]], 12, params=request_sampling(0, 1, None, 0)))
    for _ in range(5):  # decodes of one sequence alone: the padded batch of one
        engine.step()
    for name in names[1:]:
        scheduler.add(Sequence.of(name, prompts[name], 6, params=request_sampling(0, 1, None, 0)))
    while scheduler.has_work():
        engine.step()
    return {name: torch.stack(seen[name]) for name in prompts}, engine


def test_compiled_decodes_equal_eager(tmp_path_factory):
    model = _load(tmp_path_factory, "llama")
    prompts = {"a": _prompt(9, 1), "b": [7], "c": _prompt(14, 3)}  # "b": a one-token prompt
    eager, _ = _run(model, prompts, compile=False)
    calls = []
    compiled, engine = _run(model, prompts, compile=True)
    assert engine.runner.compiled is not None
    # Counted on a second run of the same engine kind: the decodes did go through the graph.
    original = engine.runner.compiled.forward
    engine.runner.compiled.forward = lambda *args: calls.append(args[0].shape[0]) or original(*args)
    scheduler = engine.scheduler
    scheduler.add(Sequence.of("d", _prompt(5, 4), 3, params=request_sampling(0, 1, None, 0)))
    while scheduler.has_work():
        engine.step()
    assert calls == [2, 2], "a lone sequence's two decodes, each padded to a batch of two"
    for name in prompts:
        assert compiled[name].shape == eager[name].shape
        torch.testing.assert_close(compiled[name], eager[name], rtol=TOL, atol=TOL)
        assert torch.equal(compiled[name].argmax(-1), eager[name].argmax(-1))


def test_a_model_it_does_not_cover_stays_eager_and_says_why(tmp_path_factory, capsys):
    model = _load(tmp_path_factory, "qwen3_moe")
    scheduler = Scheduler(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_waiting=4)
    engine = Engine(model, scheduler, compile=True)
    assert engine.runner.compiled is None
    assert "phalanx: --compile: decodes stay eager: experts" in capsys.readouterr().err


def test_served_with_compile_equals_transformers(tmp_path_factory):
    """`phalanx serve --compile` as users run it: the compile line on stderr before the serving
    line, and 8 concurrent greedy completions (batches of one to eight decodes through the one
    graph) equal to transformers' greedy ids under the near-tie rule of tests/serve_server.py."""
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from tests.serve_server import ServeProcess, assert_greedy_equal, transformers_greedy

    folder = write_checkpoint(tmp_path_factory.mktemp("served") / "llama", "llama", vocab_size=256)
    server = ServeProcess(folder, "--served-model-name", "m", "--compile", "--shutdown-grace", "1")
    try:
        deadline = time.monotonic() + 10  # stderr is read by a thread of its own: give it time
        while not any("decode step compiled in" in line for line in server.stderr) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any("decode step compiled in" in line for line in server.stderr), server.stderr
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        prompts = [_prompt(n, seed) for seed, n in enumerate([3, 9, 17, 5, 12, 7, 20, 4])]
        prompts = [[t % 256 for t in p] for p in prompts]

        def complete(prompt):
            return client.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0,
                                             extra_body={"return_token_ids": True})

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(complete, prompts))
        for answer, (reference, logits) in zip(answers, transformers_greedy(folder, prompts, 10)):
            assert_greedy_equal(answer.choices[0].token_ids, reference, logits)
    finally:
        server.stop()
