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


MTP_LAYER = BASE["num_hidden_layers"]
"""The checkpoint's multi-token-prediction layer: numbered after the model's own."""


@torch.no_grad()
def write_deepseek_mtp(folder: Path, *, seed: int = 0, bigram: bool = False, **extra) -> Path:
    """A random DeepSeek-V3 checkpoint with num_nextn_predict_layers=1: transformers writes the
    model (it has no MTP module and ignores its tensors), and the MTP layer's tensors
    (model.layers.N.*, N = num_hidden_layers, 3 by default: a decoder layer as transformers writes it, enorm, hnorm, eh_proj,
    shared_head.norm, shared_head.head, and the embedding's copy) are drawn here as `_redraw` draws.

    bigram: the draft is right by construction. Every attention output and feed-forward down
    projection of the model and of the MTP layer is zero, so the model's hidden state at i is
    Emb(t_i) and its next token a function of t_i alone: g(t_i) = argmax head(norm(Emb(t_i))).
    The MTP layer takes only the embedding (eh_proj = [I 0], the embedding first), enorm's weight
    is 1 and its head and norm are the model's: at i it gives head(norm(enorm(Emb(t_{i+1})))),
    and RMSNorm forgets the scale enorm put on, so its draft is g(t_{i+1}), the model's next
    token after t_{i+1} (up to eps 1e-6 in the two norms)."""
    from safetensors.torch import load_file, save_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    write_deepseek(folder, seed=seed, num_nextn_predict_layers=1, **extra)
    config = deepseek_config(num_nextn_predict_layers=1, **extra)
    layer = DeepseekV3DecoderLayer(config, config.num_hidden_layers)
    _redraw(layer, seed + 7)
    generator = torch.Generator().manual_seed(seed + 8)
    prefix = f"model.layers.{config.num_hidden_layers}."
    tensors = load_file(folder / "model.safetensors")
    for name, value in layer.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            value = 0.5 * torch.randn(value.shape, generator=generator)
        if name == "mlp.experts.gate_up_proj":  # (experts, 2 ffn, dim), gate rows first: per expert, as checkpoints hold them
            for expert, (gate, up) in enumerate(zip(*value.chunk(2, dim=1))):
                tensors[f"{prefix}mlp.experts.{expert}.gate_proj.weight"] = gate.contiguous()
                tensors[f"{prefix}mlp.experts.{expert}.up_proj.weight"] = up.contiguous()
        elif name == "mlp.experts.down_proj":  # (experts, dim, ffn)
            for expert, down in enumerate(value):
                tensors[f"{prefix}mlp.experts.{expert}.down_proj.weight"] = down.contiguous()
        else:
            tensors[prefix + name] = value.contiguous()
    dim, vocab = config.hidden_size, config.vocab_size
    tensors[prefix + "enorm.weight"] = 1 + 0.2 * torch.randn(dim, generator=generator)
    tensors[prefix + "hnorm.weight"] = 1 + 0.2 * torch.randn(dim, generator=generator)
    tensors[prefix + "eh_proj.weight"] = torch.randn(dim, 2 * dim, generator=generator) / (2 * dim) ** 0.5
    tensors[prefix + "shared_head.norm.weight"] = 1 + 0.2 * torch.randn(dim, generator=generator)
    tensors[prefix + "shared_head.head.weight"] = torch.randn(vocab, dim, generator=generator) / dim ** 0.5
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    if bigram:
        for name in tensors:
            if name.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
                tensors[name] = torch.zeros_like(tensors[name])
        tensors[prefix + "enorm.weight"] = torch.ones(dim)
        tensors[prefix + "eh_proj.weight"] = torch.cat([torch.eye(dim), torch.zeros(dim, dim)], dim=1)
        tensors[prefix + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
