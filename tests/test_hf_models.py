"""Hugging Face import and export against `transformers` itself, for all six families.

Tolerance: rtol = atol = 1e-4 on fp32 logits of size O(1) (see tests/hf_models.py). Both
sides run the same fp32 operations in possibly different order (fused attention kernels,
summation order of the expert combine), which moves logits by ~1e-6; a wrong rotary layout,
scaling, norm, bias or routing moves them by O(0.1).
"""

from __future__ import annotations

import json

import pytest
import torch

import phalanx.hf as hf
from phalanx.errors import UserError
from phalanx.model.hf_config import read_model_config
from tests.hf_models import FAMILIES, VOCAB, hf_logits, write_checkpoint

pytest.importorskip("transformers")
TOL = dict(rtol=1e-4, atol=1e-4)


def _tokens(seq: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


def _phalanx_logits(folder) -> torch.Tensor:
    with torch.no_grad():
        return hf.load(folder)(_tokens())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_load_and_export_match_transformers(tmp_path, family):
    folder = write_checkpoint(tmp_path / "hf", family)
    expected = hf_logits(folder, _tokens())
    assert expected.std() > 0.3, "logits too small to show a wrong rotary, norm or routing"
    ours = _phalanx_logits(folder)
    torch.testing.assert_close(ours, expected, **TOL)
    exported = hf.save(hf.load(folder), tmp_path / "out")
    assert json.loads((exported / "config.json").read_text())["model_type"] == family
    torch.testing.assert_close(hf_logits(exported, _tokens()), expected, **TOL)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_legacy_rope_form_and_sharded_files(tmp_path, family):
    """rope_theta + rope_scaling at the top level (published checkpoints) and weights split into
    shards with an index read the same as the new form in one file."""
    single = write_checkpoint(tmp_path / "one", family)
    legacy = write_checkpoint(tmp_path / "legacy", family, legacy_rope=True, shard_kb=20)
    assert (legacy / "model.safetensors.index.json").exists()
    assert "rope_parameters" not in json.loads((legacy / "config.json").read_text())
    assert read_model_config(legacy) == read_model_config(single).replace(name="legacy")
    torch.testing.assert_close(_phalanx_logits(legacy), hf_logits(single, _tokens()), **TOL)


def test_tied_embeddings(tmp_path):
    folder = write_checkpoint(tmp_path / "hf", "llama", tie_word_embeddings=True)
    model = hf.load(folder)
    assert model.output.weight is model.tok_embeddings.weight
    torch.testing.assert_close(_phalanx_logits(folder), hf_logits(folder, _tokens()), **TOL)
    exported = hf.save(model, tmp_path / "out", max_shard_bytes=8_000)  # several shards
    assert (exported / "model.safetensors.index.json").exists()
    torch.testing.assert_close(hf_logits(exported, _tokens()), hf_logits(folder, _tokens()), **TOL)


def test_preset_exports_as_the_equivalent_family(tmp_path):
    """A dense preset exports as llama and a softmax MoE preset as mixtral, same logits."""
    from phalanx.model.by_name import model_config
    from phalanx.model.init import build_model, init_weights

    for name, family in (("tiny", "llama"), ("tiny-moe", "mixtral")):
        cfg = model_config(name)
        model = init_weights(build_model(cfg), cfg, seed=3, device="cpu").eval()
        tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            ours = model(tokens)
        out = hf.save(model, tmp_path / name)
        assert json.loads((out / "config.json").read_text())["model_type"] == family
        torch.testing.assert_close(hf_logits(out, tokens), ours, **TOL)


def test_sigmoid_router_has_no_equivalent(tmp_path):
    from phalanx.model.by_name import model_config
    from phalanx.model.init import build_model, init_weights

    cfg = model_config("small-moe").replace(dim=32, n_heads=2, n_kv_heads=2, ffn_dim=32, expert_ffn_dim=16)
    model = init_weights(build_model(cfg), cfg, seed=0, device="cpu")
    with pytest.raises(UserError, match="no Hugging Face equivalent: router='sigmoid'"):
        hf.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_kv_cache_decoding_equals_full_recompute(tmp_path):
    """Prefill then one token at a time through the cache gives the logits of running the
    whole prefix at once, with a sliding window shorter than the sequence."""
    from phalanx.model.kv_cache import KVCache

    model = hf.load(write_checkpoint(tmp_path / "hf", "mistral"))
    tokens = _tokens(20)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(max_len=20)
        steps = [model(tokens[:, :12], cache)] + [model(tokens[:, i:i + 1], cache) for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)
