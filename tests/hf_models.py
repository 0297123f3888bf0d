"""Tiny random Hugging Face checkpoints of every trainable family, written by `transformers`
itself, for the import/export tests.

Weights are redrawn so the logits are O(1) (transformers' 0.02 init gives logits near zero,
where a wrong rotary scaling, norm or routing would hide): matrices with std 1/sqrt(fan-in),
norm weights 1 + 0.2 N(0, 1), biases 0.2 N(0, 1), embeddings N(0, 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
              bos_token_id=None, eos_token_id=None)  # no tokenizer, no end of sequence: generations run to max_tokens
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 50000.0}
FAMILIES = {
    # rope scaled for a 16-position original context, so positions up to 40 reach every band
    "llama": dict(rope_parameters=LLAMA3_ROPE),
    "mistral": dict(sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
    "qwen2": dict(use_sliding_window=False),
    "qwen3": dict(head_dim=12),  # explicit, not hidden / heads
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[1], head_dim=8),
}


def _config(family: str, **extra):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    return cls(**{**COMMON, **FAMILIES[family], **extra})


@torch.no_grad()
def _redraw(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if "norm" in name:
            param.copy_(1 + 0.2 * noise)
        elif name.endswith("bias"):
            param.copy_(0.2 * noise)
        elif "embed_tokens" in name:
            param.copy_(noise)
        else:
            param.copy_(noise / param.shape[-1] ** 0.5)


def write_checkpoint(folder: Path, family: str, *, legacy_rope: bool = False, shard_kb: int = 0, seed: int = 0,
                     **extra) -> Path:
    """Save a random `family` model with transformers; returns its directory.

    legacy_rope: rewrite config.json in the older form (rope_theta and rope_scaling at the top
    level) that most published checkpoints have. shard_kb: split the weights into shards."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(_config(family, **extra)).eval()
    _redraw(model, seed)
    kwargs = {"max_shard_size": f"{shard_kb}KB"} if shard_kb else {}
    model.save_pretrained(folder, **kwargs)
    if legacy_rope:
        path = folder / "config.json"
        data = json.loads(path.read_text())
        rope = data.pop("rope_parameters")
        data["rope_theta"] = rope.pop("rope_theta")
        data["rope_scaling"] = rope if rope.get("rope_type") != "default" else None
        path.write_text(json.dumps(data))
    return folder


def write_word_tokenizer(folder: Path, vocab: int, special: dict[str, int] | None = None, bos: str | None = None) -> None:
    """A word-level tokenizer.json in `folder`: "w0" ... "w{vocab-1}" are ids 0 ... vocab-1 (w0
    also the unknown word), split on whitespace, so a test writes prompts as words. `special`:
    special tokens that take the place of those ids' words; `bos`: one of them, added before
    every text by the post-processor (as Llama's tokenizer adds its BOS)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    special = special or {}
    words = {f"w{i}": i for i in range(vocab) if i not in special.values()} | special
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in special])
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, special[bos])])
    tokenizer.save(str(folder / "tokenizer.json"))


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits
