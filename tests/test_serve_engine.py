"""The serving engine without HTTP: paged attention against the contiguous cache of `phalanx
generate`, and batch invariance (a sequence's logits do not depend on what runs beside it).

Tolerance 1e-5 on fp32 logits of size O(1) (tests/hf_models.py): a packed step attends over
exactly the keys a sequence sees alone (the block-diagonal mask gives the others' keys
probability 0), so only the order of sums changes: one-row against many-row matmuls, a
masked softmax over more keys, expert products over more rows (~1e-6). The models multiply
as the server's do, through oneDNN on CPU (`cpu_ops/onednn_linear.py`). A wrong slot,
position, rotary row or mask moves the logits by O(0.1).
"""

from __future__ import annotations

import pytest
import torch

import phalanx.hf as hf
from phalanx.inference.decoding import generate_ids
from phalanx.inference.sampling import Sampling
from phalanx.cpu_ops.onednn_linear import use_onednn
from phalanx.cpu_ops import decode_kernel as cpu_decode_kernel
from phalanx.serve.engine import Engine
from phalanx.serve.sampling_params import request_sampling
from phalanx.serve.paged_cache import ChunkLayout, PagedKVCache
from phalanx.scheduling.scheduler import Scheduler, Sequence
from tests.deepseek_models import write_deepseek
from tests.hf_models import VOCAB, write_checkpoint

pytest.importorskip("transformers")
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for these small steps: two spinning OpenMP threads on a shared machine
    made each step many times slower (tests/serve_server.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    loaded: dict = {}

    def get(family: str):
        if family not in loaded:
            folder = tmp_path_factory.mktemp(family) / "hf"
            model = hf.load(write_deepseek(folder) if family == "deepseek" else write_checkpoint(folder, family))
            use_onednn(model)  # as `phalanx serve` and `phalanx generate` load it on CPU
            loaded[family] = model
        return loaded[family]

    return get


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(params=["from-pool", "gathered"])
def decode_read(request, monkeypatch):
    """Ragged decodes both ways: read straight from the pool by the CPU kernel (the engine's
    way on CPU in float32, cpu_ops/decode_kernel.py) and gathered for the flash kernel (on
    CUDA, in bf16, or without a C compiler)."""
    monkeypatch.setattr(cpu_decode_kernel, "ON", request.param == "from-pool")
    return request.param


@pytest.mark.parametrize("family,ragged", [("llama", True), ("mistral", True), ("mistral", False), ("deepseek", False)],
                         ids=["llama-ragged", "mistral-ragged", "mistral-masked", "deepseek-masked"])
def test_paged_attention_equals_contiguous_cache(models, family, ragged, decode_read):
    """A prompt of 20 in a scattered block table (blocks 5, 2, 7 of 4 positions... and on),
    prefilled in two chunks, then 10 one-token steps: every step's logits against
    `generate_ids` with the contiguous KVCache; mistral's window of 8 is shorter than the 30
    positions, so the paged attention must drop old keys too. Both ways the cache serves
    attention: per sequence over its own keys (ragged, the engine's) and padded keys with a
    mask (what latent attention's absorbed form reads: deepseek, as the engine runs it)."""
    model = models(family)
    prompt, new = [t % model.cfg.vocab_size for t in _prompt(20, 1)], 10
    reference: list[torch.Tensor] = []
    ids = generate_ids(model, prompt, max_new_tokens=new, max_len=128, sampling=Sampling(greedy=True),
                       on_logits=reference.append).new_ids
    table = [5, 2, 7, 0, 9, 3, 11, 1]  # 8 blocks of 4: 32 positions, none in order
    kernel = cpu_decode_kernel.usable(torch.device("cpu"), torch.float32)
    assert kernel == (decode_read == "from-pool")
    cache = PagedKVCache(num_blocks=12, block_size=4, ragged=ragged, pool_kernel=kernel)
    tokens = prompt + ids
    ours = []
    with torch.no_grad():
        for start, length in [(0, 13), (13, 7)] + [(20 + i, 1) for i in range(new - 1)]:
            cache.prepare([ChunkLayout(table, start, length)])
            feed = torch.tensor([tokens[start:start + length]])
            logits = model(feed, cache, read_at=torch.tensor([length - 1]))[0, -1]
            if start + length >= len(prompt):
                ours.append(logits)
    assert len(ours) == new
    torch.testing.assert_close(torch.stack(ours), torch.stack(reference), rtol=TOL, atol=TOL)


def _run(model, prompts: dict[str, list[int]], max_tokens: int, scheduler_out: list | None = None,
         **limits) -> dict[str, torch.Tensor]:
    """Greedy through the engine; the logits each sequence's tokens were picked from."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in prompts}
    settings = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_waiting=16) | limits
    scheduler = Scheduler(**settings)
    engine = Engine(model, scheduler, on_logits=lambda seq, row: seen[seq.seq_id].append(row.clone()))
    assert engine.runner.cache.pool_kernel == cpu_decode_kernel.ON  # the way the test asked for
    for name, prompt in prompts.items():
        scheduler.add(Sequence.of(name, prompt, max_tokens, params=request_sampling(0, 1, None, 0)))
    while scheduler.has_work():
        engine.step()
    if scheduler_out is not None:
        scheduler_out.append(scheduler)
    return {name: torch.stack(rows) for name, rows in seen.items()}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mistral"])
def test_batch_invariance(models, family, decode_read):
    """Sequence "a" alone, then beside four others of other lengths under a 24-token budget
    (so "a"'s prompt of 30 is prefilled in chunks while others decode, and the batch changes
    as they finish): its logits at every step within 1e-5. Their decodes attend in groups
    padded to the group's longest (paged_attention.py): "e"'s 90 positions are more than
    PADDING_KEYS beyond "b"'s, so there are two; mistral's window of 8 cuts every row of a
    group at its own length."""
    model = models(family)
    alone = _run(model, {"a": _prompt(30, 2)}, 8)["a"]
    together = _run(model, {"b": _prompt(5, 3), "a": _prompt(30, 2), "c": _prompt(17, 4), "d": _prompt(9, 5),
                            "e": _prompt(90, 9)}, 8, max_num_batched_tokens=24)
    assert together["a"].shape == (8, VOCAB)
    torch.testing.assert_close(together["a"], alone, rtol=TOL, atol=TOL)
    assert together["a"].argmax(-1).unique().numel() > 2, "a degenerate model would prove little"


def test_preemption_recomputes_to_the_same_logits(models):
    """Eight blocks of 4 for three sequences that need 5-6 each: they preempt one another and
    recompute; every sequence's logits equal its run alone within 1e-5."""
    model = models("llama")
    prompts = {"a": _prompt(12, 6), "b": _prompt(10, 7), "c": _prompt(14, 8)}
    alone = {name: _run(model, {name: prompt}, 10)[name] for name, prompt in prompts.items()}
    schedulers: list = []
    scheduler_runs = _run(model, prompts, 10, schedulers, num_blocks=8)
    assert schedulers[0].preemptions > 0
    for name in prompts:
        torch.testing.assert_close(scheduler_runs[name], alone[name], rtol=TOL, atol=TOL)
