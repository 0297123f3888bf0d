"""Tiny random DeepSeek-V3 checkpoints written by `transformers` itself, for the tests of
latent attention, DeepSeekMoE routing, generation and layouts.

Weights are redrawn as in tests/hf_models.py (logits O(1)), and each router's
score-correction bias is drawn too, large enough (0.5 N(0, 1) against sigmoid scores in
(0, 1)) that it changes which experts are chosen: `chosen_experts_differ` checks that it does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.hf_models import _redraw

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=12, v_head_dim=10, n_group=1, topk_group=1, routed_scaling_factor=2.5,
            max_position_embeddings=128, rms_norm_eps=1e-6, rope_interleave=True)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}
"""A context stretched 8 times from 16 positions (positions up to 40 reach every band);
mscale != mscale_all_dim, so both YaRN corrections (rotated channels, softmax) are exercised."""
VARIANTS = {
    "q_lora": {},
    "plain_q": dict(q_lora_rank=None),
    "groups": dict(n_group=4, topk_group=2, rope_interleave=False),
    "yarn": dict(n_group=2, topk_group=1, rope_parameters=YARN),
}


def deepseek_config(**extra):
    import transformers

    return transformers.DeepseekV3Config(**{**BASE, **extra})


@torch.no_grad()
def write_deepseek(folder: Path, *, seed: int = 0, legacy_rope: bool = False, **extra) -> Path:
    """Save a random DeepseekV3ForCausalLM with transformers; returns its directory."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(deepseek_config(**extra)).eval()
    _redraw(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.5 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(folder)
    if legacy_rope:  # rope_theta and rope_scaling at the top level, as the published config.json
        path = folder / "config.json"
        data = json.loads(path.read_text())
        rope = data.pop("rope_parameters")
        data["rope_theta"] = rope.pop("rope_theta")
        data["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in rope.items()}
        path.write_text(json.dumps(data))
    return folder


def tokens(seq: int = 40, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
