"""DeepSeek-V3 generation: the latent cache in the absorbed form against the decompressed
computation, and greedy `phalanx generate` against `transformers.generate`.

Tolerance 1e-4 on fp32 logits of size O(1), as tests/test_generate.py: the absorbed form
multiplies the same numbers in another order ((W_uk^T q) . c instead of q . (W_uk c)), ~1e-6;
a wrong latent slot, rotary row or up-projection split moves them by O(0.1).
"""

from __future__ import annotations

import json

import pytest
import torch

import phalanx.hf as hf
from phalanx.cli import main
from phalanx.inference.decoding import generate_ids
from phalanx.inference.sampling import Sampling
from phalanx.model.kv_cache import KVCache
from phalanx.model.latent_attention import LatentAttention
from tests.deepseek_models import BASE, VARIANTS, VOCAB, write_deepseek

pytest.importorskip("transformers")
NEW = 24  # prompt 16 + 24: positions up to 40, past YaRN's original context of 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_deepseek(tmp_path_factory.mktemp("dsv3") / "hf", **VARIANTS["yarn"])


def _prompt(length: int = 16) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(5)).tolist()


def _set_absorbed(model, absorbed: bool) -> None:
    for module in model.modules():
        if isinstance(module, LatentAttention):
            module.absorbed = absorbed


def test_latent_cache_holds_the_latent_and_equals_decompressed_attention(checkpoint):
    """Every step's logits: absorbed latent cache = decompressed key/value cache = the whole
    context recomputed; the latent cache holds (batch, 1, positions, kv_lora_rank) and
    (batch, 1, positions, qk_rope_head_dim) per layer, nothing per head; a chunked prefill
    reads the latents cached before it."""
    model = hf.load(checkpoint)
    runs = {}
    for mode in ("absorbed", "decompressed", "recompute"):
        _set_absorbed(model, mode == "absorbed")
        seen: list[torch.Tensor] = []
        result = generate_ids(model, _prompt(), max_new_tokens=12, max_len=128, use_cache=mode != "recompute",
                              sampling=Sampling(seed=3, temperature=1.0, top_k=0), on_logits=seen.append)
        runs[mode] = (result.new_ids, torch.stack(seen))
    _set_absorbed(model, True)
    for mode in ("decompressed", "recompute"):
        assert runs["absorbed"][0] == runs[mode][0], mode
        torch.testing.assert_close(runs["absorbed"][1], runs[mode][1], rtol=1e-4, atol=1e-4)
    cache = KVCache(max_len=20)
    with torch.no_grad():
        model(torch.tensor([_prompt()]), cache)
    assert tuple(cache.keys[0].shape) == (1, 1, 20, BASE["kv_lora_rank"])
    assert tuple(cache.values[0].shape) == (1, 1, 20, BASE["qk_rope_head_dim"])
    # A prefill in chunks (later chunks decompress the latents cached before them), then steps.
    tokens = torch.tensor([_prompt(24)])
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(max_len=24)
        steps = [model(tokens[:, :10], cache), model(tokens[:, 10:16], cache)]
        steps += [model(tokens[:, i:i + 1], cache) for i in range(16, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def _transformers_greedy(folder, prompt: list[int], new: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # no tokenizer: phalanx stops at no eos either
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new)
    return out[0, len(prompt):].tolist()


def test_greedy_phalanx_generate_equals_transformers(capsys, checkpoint):
    prompt = _prompt()
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(checkpoint), "--prompt-ids", ",".join(map(str, prompt)), "--greedy",
              "--max-new-tokens", str(NEW), "--json"])
    assert exit_info.value.code == 0
    ours = json.loads(capsys.readouterr().out)["new_ids"]
    assert ours == _transformers_greedy(checkpoint, prompt, NEW)
    assert len(set(ours)) > 3, "a degenerate model would repeat one token and prove little"


def test_tp2_generation_equals_one_process(checkpoint):
    """Under tp=2 each rank caches the latents (replicated: the down-projection is) and decodes
    its own heads absorbed with its rows of wkv_b; the gathered logits pick one process's tokens."""
    from phalanx.testing.fork_ranks import run_ranks
    from tests.test_generate import GREEDY, _generate_on_rank, _one_process

    expected = _one_process(str(checkpoint), GREEDY)
    for rank_result in run_ranks(2, _generate_on_rank, str(checkpoint), "tp=2", GREEDY):
        assert rank_result == expected
