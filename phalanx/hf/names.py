"""Parameter names: phalanx's canonical names <-> the tensor names of Hugging Face checkpoints.

phalanx stacks a layer's experts into one (n_experts, ...) tensor per weight; checkpoints
store one tensor per expert, under names that differ by family:
  mixtral:   model.layers.N.block_sparse_moe.experts.E.{w1,w2,w3}.weight
  qwen3_moe, deepseek_v3: model.layers.N.mlp.experts.E.{gate_proj,down_proj,up_proj}.weight
DeepSeek-V3's latent attention has its own projection names (`_LATENT`), and its router's
score-correction bias (a buffer, `router.expert_bias` here) is a checkpoint tensor.
Torch-free: export planning and checks need only names.
"""

from __future__ import annotations

import re

from phalanx.errors import UserError

_ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"}
_LATENT = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
           "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_DENSE = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT = {
    "mixtral": {"w1": "w1", "w2": "w2", "w3": "w3"},
    "qwen3_moe": _DENSE,
    "deepseek_v3": _DENSE,
}
_MOE_BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp", "deepseek_v3": "mlp"}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def hf_names(name: str, family: str, n_experts: int = 0) -> list[str]:
    """The checkpoint tensor(s) holding phalanx parameter `name`: one name, or for an expert
    stack one name per expert in expert order."""
    if name in _TOP:
        return [_TOP[name]]
    match = _LAYER.fullmatch(name)
    if match is None:
        raise UserError(f"parameter {name!r} has no Hugging Face counterpart")
    layer, rest = match.groups()
    prefix = f"model.layers.{layer}."
    parts = rest.split(".")
    if rest == "attention_norm.weight":
        return [prefix + "input_layernorm.weight"]
    if rest == "ffn_norm.weight":
        return [prefix + "post_attention_layernorm.weight"]
    attention = _LATENT if family == "deepseek_v3" else _ATTENTION
    if parts[0] == "attention" and parts[1] in attention:
        return [prefix + f"self_attn.{attention[parts[1]]}.{parts[2]}"]
    if parts[0] == "feed_forward" and parts[1] in _DENSE and len(parts) == 3:
        return [prefix + f"mlp.{_DENSE[parts[1]]}.{parts[2]}"]
    if family in _MOE_BLOCK and rest == "feed_forward.router.gate.weight":
        return [prefix + f"{_MOE_BLOCK[family]}.gate.weight"]
    if family == "deepseek_v3" and rest == "feed_forward.router.expert_bias":
        return [prefix + "mlp.gate.e_score_correction_bias"]  # a buffer: chooses experts, never weights them
    if family == "deepseek_v3" and parts[:2] == ["feed_forward", "shared"] and parts[2] in _DENSE:
        return [prefix + f"mlp.shared_experts.{_DENSE[parts[2]]}.{parts[3]}"]
    if family in _EXPERT and parts[:2] == ["feed_forward", "experts"] and parts[2] in _EXPERT[family]:
        weight = _EXPERT[family][parts[2]]
        return [prefix + f"{_MOE_BLOCK[family]}.experts.{e}.{weight}.weight" for e in range(n_experts)]
    raise UserError(f"parameter {name!r} has no counterpart in a {family} checkpoint")


def is_expert_stack(name: str) -> bool:
    return ".feed_forward.experts." in name


IGNORED_CHECKPOINT_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")
"""Tensors some older checkpoints carry that are derived, not learned: skipped on load."""
