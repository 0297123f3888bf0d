"""DeepSeek-V3 (latent attention, DeepSeekMoE) against `transformers`' DeepseekV3ForCausalLM.

Tolerance: rtol = atol = 1e-4 on fp32 logits of size O(1), as tests/test_hf_models.py: the
same fp32 operations in a different order move logits by ~1e-6; a wrong rotary layout or
scale, latent norm, group mask or correction bias moves them by O(0.1).
"""

from __future__ import annotations

import json

import pytest
import torch

import phalanx.hf as hf
from phalanx.errors import UserError
from phalanx.model.hf_config import read_model_config
from tests.deepseek_models import VARIANTS, tokens, write_deepseek
from tests.hf_models import hf_logits

pytest.importorskip("transformers")
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_export_match_transformers(tmp_path, variant):
    folder = write_deepseek(tmp_path / "hf", **VARIANTS[variant])
    expected = hf_logits(folder, tokens())
    assert expected.std() > 0.3, "logits too small to show a wrong rotary, norm or routing"
    model = hf.load(folder)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), expected, **TOL)
    exported = hf.save(model, tmp_path / "out")
    assert json.loads((exported / "config.json").read_text())["model_type"] == "deepseek_v3"
    torch.testing.assert_close(hf_logits(exported, tokens()), expected, **TOL)


def test_published_config_form_reads_the_same(tmp_path):
    """rope_theta + rope_scaling {"type": "yarn", ...} at the top level, as DeepSeek-V3's own
    config.json, is the same model as transformers 5's rope_parameters."""
    new = write_deepseek(tmp_path / "new", **VARIANTS["yarn"])
    legacy = write_deepseek(tmp_path / "legacy", legacy_rope=True, **VARIANTS["yarn"])
    assert "rope_parameters" not in json.loads((legacy / "config.json").read_text())
    cfg = read_model_config(legacy)
    assert cfg == read_model_config(new).replace(name="legacy")
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_mscale, cfg.expert_groups, cfg.topk_groups) == ("yarn", 8.0, 0.707, 2, 1)
    with torch.no_grad():
        torch.testing.assert_close(hf.load(legacy)(tokens()), hf_logits(new, tokens()), **TOL)


def test_correction_bias_changes_the_choice_not_the_weights(tmp_path):
    """The checkpoint's e_score_correction_bias is loaded and changes which experts some
    tokens visit (so the logits test above covers it); zeroing it changes the logits."""
    folder = write_deepseek(tmp_path / "hf", **VARIANTS["groups"])
    model = hf.load(folder)
    moe = model.layers["1"].feed_forward
    assert moe.router.expert_bias.abs().max() > 0.1
    hidden = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        biased = moe.router(hidden).experts.sort(dim=-1).values
        bias = moe.router.expert_bias.clone()
        moe.router.expert_bias.zero_()
        plain = moe.router(hidden).experts.sort(dim=-1).values
        moe.router.expert_bias.copy_(bias)
    assert (biased != plain).any(dim=-1).float().mean() > 0.2


def test_group_limited_routing_stays_within_topk_groups():
    """Property: whatever the scores and bias, no token's experts span more than topk_groups
    groups; without the limit the same router spans more (so the limit is what holds them)."""
    from phalanx.model.router import Router

    def groups_spanned(route, per_group: int) -> torch.Tensor:
        return torch.tensor([torch.unique(row // per_group).numel() for row in route.experts.unbind()])

    generator = torch.Generator().manual_seed(0)
    for groups, topk_groups, n_experts, k in ((4, 1, 16, 3), (4, 2, 16, 4), (8, 3, 32, 8), (2, 2, 8, 2)):
        router = Router(12, n_experts, k, score="sigmoid", groups=groups, topk_groups=topk_groups)
        with torch.no_grad():
            router.gate.weight.copy_(torch.randn(n_experts, 12, generator=generator))
            router.expert_bias.copy_(torch.randn(n_experts, generator=generator))
            x = torch.randn(200, 12, generator=generator)
            limited = groups_spanned(router(x), n_experts // groups)
            router.topk_groups = groups
            free = groups_spanned(router(x), n_experts // groups)
        assert limited.max() <= topk_groups, (groups, topk_groups)
        if topk_groups < groups:
            assert free.max() > topk_groups


def test_checkpoint_problems_are_one_line_errors(tmp_path):
    folder = write_deepseek(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    cases = [
        (dict(qk_head_dim=99), "inconsistent head split: qk_head_dim=99"),
        (dict(n_group=3), "n_experts=8 cannot be divided into expert_groups=3"),
        (dict(n_group=2, topk_group=4), "topk_groups=4 must be in 1..expert_groups=2"),
        (dict(num_key_value_heads=2), "n_kv_heads=2 must equal n_heads=4"),
        (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope type 'longrope' is not supported"),
        (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config .* is not supported"),
    ]
    for change, message in cases:
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError, match=message):
            hf.load(folder)
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(UserError, match="no tensor 'model.layers.1.self_attn.kv_b_proj.weight'"):
        hf.load(folder)


def test_fp8_block_quantized_checkpoint_is_dequantized_on_load(tmp_path):
    """The test quantizes a checkpoint as DeepSeek-V3 is published (float8_e4m3fn matrices in
    blocks with a weight_scale_inv each); loading it gives the model of the dequantized
    weights exactly (the same fp32 products), which transformers computes from them too."""
    from safetensors.torch import load_file, save_file

    from phalanx.hf.fp8_weights import dequantize

    folder = write_deepseek(tmp_path / "hf")
    block = (8, 8)
    tensors, dequantized = load_file(folder / "model.safetensors"), {}
    for name in [n for n, t in tensors.items() if t.ndim == 2 and "proj" in n]:
        weight = tensors[name]
        rows, cols = -(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])
        padded = torch.zeros(rows * block[0], cols * block[1])
        padded[:weight.shape[0], :weight.shape[1]] = weight
        scale = padded.view(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3)) / 448 + 1e-12  # (rows, cols) blocks
        quantized = (weight / scale.repeat_interleave(block[0], 0)[:weight.shape[0]]
                     .repeat_interleave(block[1], 1)[:, :weight.shape[1]]).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = quantized, scale
        dequantized[name] = dequantize(quantized, scale, block)
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(config))
    model = hf.load(folder)
    assert torch.equal(model.layers["1"].attention.wkv_b.weight, dequantized["model.layers.1.self_attn.kv_b_proj.weight"])
    plain = tmp_path / "plain"
    hf.save(model, plain)  # written back unquantized, in fp32
    torch.testing.assert_close(hf_logits(plain, tokens()), model(tokens()).detach(), **TOL)


def test_multi_token_prediction_layers_are_skipped_and_said(tmp_path, capsys):
    """A published checkpoint holds its num_nextn_predict_layers=1 MTP layer as layer
    num_hidden_layers: its tensors are skipped (said on stderr); a tensor of a layer beyond it
    is still an error."""
    from safetensors.torch import load_file, save_file

    from phalanx.model import hf_config

    folder = write_deepseek(tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    expected = hf_logits(folder, tokens())
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)  # layer 3 of 3: the MTP module
    save_file(tensors, folder / "model.safetensors")
    hf_config.SAID.clear()
    with torch.no_grad():
        torch.testing.assert_close(hf.load(folder)(tokens()), expected, **TOL)
    assert "num_nextn_predict_layers=1 multi-token prediction layer(s) skipped" in capsys.readouterr().err
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(UserError, match="'model.layers.4.eh_proj.weight' would be ignored"):
        hf.load(folder)
