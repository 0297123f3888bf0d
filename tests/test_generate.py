"""Generation with a KV cache against `transformers`' own `generate`, against recomputing the
whole prefix, and under tensor parallelism against one process.

Tolerance for cached vs recomputed logits: rtol = atol = 1e-4 on fp32 logits of size O(1)
(tests/hf_models.py). The cached step attends over the same keys and values as the full
recompute, but in a one-query matmul instead of a causal-masked block, so sums run in another
order (~1e-6); a wrong position, rotary row, mask or cache slot moves them by O(0.1).
"""

from __future__ import annotations

import pytest
import torch

import phalanx.hf as hf
from phalanx.inference.decoding import generate_ids
from phalanx.inference.model_source import load_model, resolve_model
from phalanx.inference.sampling import Sampling
from phalanx.testing.fork_ranks import run_ranks
from tests.hf_models import VOCAB, write_checkpoint

pytest.importorskip("transformers")
GREEDY = Sampling(greedy=True)
NEW = 24  # against transformers: prompt 16 + 24 reaches every band of the llama3 rope scaling
SHORT = 12  # elsewhere: enough steps past mistral's window of 8, fewer seconds


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One tiny checkpoint per family, written on first use and shared by this module's tests."""
    written: dict = {}

    def get(family: str):
        if family not in written:
            written[family] = write_checkpoint(tmp_path_factory.mktemp(family) / "hf", family)
        return written[family]

    return get


def _prompt(length: int = 16) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(5)).tolist()


def _transformers_greedy(folder, prompt: list[int], new: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # No end-of-text stopping on either side: phalanx stops only at a tokenizer's eos, and these
    # checkpoints have no tokenizer.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_greedy_equals_transformers_generate(checkpoint, family):
    """Prompt 16 + 24 new tokens: positions up to 40 reach every band of the llama3 rope scaling."""
    folder = checkpoint(family)
    prompt = _prompt()
    ours = generate_ids(hf.load(folder), prompt, max_new_tokens=NEW, max_len=128, sampling=GREEDY).new_ids
    assert ours == _transformers_greedy(folder, prompt, NEW)
    assert len(set(ours)) > 3, "a degenerate model would repeat one token and prove little"


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3_moe"])
def test_kv_cache_equals_recomputing_the_prefix(checkpoint, family):
    """Every step's logits, cached vs the whole context recomputed; mistral's sliding window of 8
    is shorter than the 28 positions, so the cached mask must drop old keys too."""
    model = hf.load(checkpoint(family))
    runs = {}
    for use_cache in (True, False):
        seen: list[torch.Tensor] = []
        result = generate_ids(model, _prompt(), max_new_tokens=SHORT, max_len=128, use_cache=use_cache,
                              sampling=Sampling(seed=3, temperature=1.0, top_k=0), on_logits=seen.append)
        runs[use_cache] = (result.new_ids, torch.stack(seen))
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].shape == (SHORT, VOCAB)
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-4, atol=1e-4)


def _generate_on_rank(model_arg: str, plan: str, sampling: Sampling) -> list[int]:
    import torch.distributed as dist

    from phalanx.parallel.mesh import build_mesh
    from phalanx.plan import plan_from_string

    mesh = build_mesh(plan_from_string(plan, dist.get_world_size()), torch.device("cpu"))
    model = load_model(resolve_model(model_arg), mesh)
    return generate_ids(model, _prompt(), max_new_tokens=SHORT, max_len=128, sampling=sampling).new_ids


def _one_process(model_arg: str, sampling: Sampling) -> list[int]:
    from phalanx.parallel.mesh import build_mesh
    from phalanx.plan import plan_from_string

    model = load_model(resolve_model(model_arg), build_mesh(plan_from_string("dp=1", 1), torch.device("cpu")))
    return generate_ids(model, _prompt(), max_new_tokens=SHORT, max_len=128, sampling=sampling).new_ids


@pytest.mark.parametrize("family, modes", [("llama", ("greedy", "sampled")), ("mixtral", ("greedy",))])
def test_tp2_equals_one_process(checkpoint, family, modes):
    """Each rank caches its own heads; the gathered logits pick the same tokens as one process,
    greedy and sampled (every rank draws from identical full logits with the same seed)."""
    folder = str(checkpoint(family))
    chosen = {"greedy": GREEDY, "sampled": Sampling(seed=11, temperature=1.0, top_k=20, top_p=0.9)}
    chosen = {mode: chosen[mode] for mode in modes}
    expected = {mode: _one_process(folder, sampling) for mode, sampling in chosen.items()}

    def on_rank() -> dict:
        return {mode: _generate_on_rank(folder, "tp=2", sampling) for mode, sampling in chosen.items()}

    for rank_result in run_ranks(2, on_rank):
        assert rank_result == expected


def test_run_directory_under_tp2_equals_the_model_it_holds(tmp_path, checkpoint):
    """A run's DCP checkpoint loads into one process and into tp=2 and generates what the
    Hugging Face directory it was saved from generates."""
    from phalanx.checkpoint.store import save_checkpoint

    model = hf.load(checkpoint("llama"))
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path / "run", 5, model, optimizer, rank=0, keep=1, meta={"model": model.cfg.to_dict(), "train": {}})
    expected = generate_ids(model, _prompt(), max_new_tokens=SHORT, max_len=128, sampling=GREEDY).new_ids
    run = str(tmp_path / "run")
    assert _one_process(run, GREEDY) == expected
    assert run_ranks(2, _generate_on_rank, run, "tp=2", GREEDY) == [expected, expected]
