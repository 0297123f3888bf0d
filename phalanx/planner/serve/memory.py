"""A serving rank's memory: its weights, the step's working memory, and what is left for the
KV cache, hence how many sequences (`max_batch`) of isl + osl tokens a dp rank can hold.

The pool is sized as vLLM sizes it (serving-facts.md): a fraction `KV_UTILIZATION` of the
device (vLLM's `gpu_memory_utilization`, 0.9) less the weights and the step's activations,
never more than the device less the cluster's reserve. An engine that sizes it otherwise is a
`PoolRule`: TensorRT-LLM takes a fraction of the memory the weights and the runtime leave free
(`kv_cache_free_gpu_mem_fraction`) and trtllm-bench caps the running batch at 4,096 (its
tuning.py); the published-run benchmark prices such runs by their engine's rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.model.config import ModelConfig
from phalanx.planner.hardware import Cluster
from phalanx.planner.memory import param_counts
from phalanx.planner.serve.step import WEIGHT_BYTES, ServeLayout, act_bytes, kv_bytes_per_token_layer, stage_layers

KV_UTILIZATION = 0.9
BLOCK_SIZE = 16
"""Positions per KV block (vLLM's and phalanx serve's default): a sequence wastes at most one."""
MAX_BATCH_LIMIT = 1024
"""The most sequences per dp rank the search gives a step (TensorRT-LLM's and SGLang's
running-batch limits are of this order; past it the sampling and scheduling host work grows
faster than the batch pays)."""


@dataclass(frozen=True, kw_only=True)
class PoolRule:
    """How an engine sizes its KV pool and caps its running batch per dp rank."""
    fraction: float = KV_UTILIZATION
    of_free: bool = False
    """False: `fraction` of the device less the weights and the step's memory (vLLM's
    gpu_memory_utilization); True: `fraction` of what the weights, the step's memory and the
    cluster's reserve leave (TensorRT-LLM's kv_cache_free_gpu_mem_fraction)."""
    max_batch: int = MAX_BATCH_LIMIT


VLLM_POOL = PoolRule()


@dataclass(frozen=True)
class RankMemory:
    weights: float
    workspace: float
    kv_pool: float
    """Bytes, on the most loaded rank."""
    kv_per_token: float
    """Bytes one token's cache takes on a rank (its stage's layers)."""

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_pool // self.kv_per_token))


def weight_bytes(model: ModelConfig, layout: ServeLayout) -> float:
    """Weights on the most loaded rank: dense parts over tp, routed expert slots (S / ep of
    them, replicas included) over tp, the embedding and output head over tp (both counted on
    the stage, conservatively)."""
    c = param_counts(model)
    layers, moe_layers = stage_layers(model, layout.pp)
    dense = layers * (c.attention + c.norms) + (layers - moe_layers) * c.dense_mlp + moe_layers * c.moe_other
    heads = 1 if model.tie_embeddings else 2
    dense += heads * c.embedding
    per_expert_slots = layout.slot_count(model.n_experts) / model.n_experts if model.n_experts else 1.0
    routed = moe_layers * c.experts * per_expert_slots / layout.ep
    return (dense + routed) / layout.tp * WEIGHT_BYTES[layout.weight_dtype]


def workspace_bytes(model: ModelConfig, layout: ServeLayout, max_batch_tokens: int, max_batch: int) -> float:
    """The step's transient tensors: a few hidden-size activations per token, the widest
    feed-forward's intermediate, and fp32 logits of the sampled rows."""
    ffn = max(model.ffn_dim, model.experts_per_token * model.moe_ffn_dim if model.n_experts else 0)
    per_token = act_bytes(layout) * (4 * model.dim + 3 * ffn / layout.tp)
    return max_batch_tokens * per_token + max_batch * model.vocab_size / layout.tp * 4


def rank_memory(model: ModelConfig, cluster: Cluster, layout: ServeLayout, *, max_batch_tokens: int,
                max_batch: int = MAX_BATCH_LIMIT, pool: PoolRule = VLLM_POOL) -> RankMemory:
    weights = weight_bytes(model, layout)
    workspace = workspace_bytes(model, layout, max_batch_tokens, max_batch)
    layers, _ = stage_layers(model, layout.pp)
    per_token = layers * kv_bytes_per_token_layer(model, layout)
    if pool.of_free:
        kv = pool.fraction * (cluster.usable_bytes - weights - workspace)
    else:
        kv = min(cluster.memory_gib * pool.fraction * 2**30, cluster.usable_bytes) - weights - workspace
    return RankMemory(weights, workspace, max(0.0, kv), per_token)


def trtllm_bench_max_num_tokens(kv_max_requests: float, *, isl: int, osl: int, pp: int = 1) -> int:
    """The step's token budget trtllm-bench gives an engine when none is set (its
    `finetune_setting`, tensorrt_llm/bench/build/tuning.py): room for the running batch's
    decodes and the prompt tokens that keep it full, raw = min(requests, 4096) / pp x (1 + isl
    / osl), at most 32,768, rounded up to 256 (at least 2,048) below 4,096, to 512 below 8,192,
    else to 1,024."""
    raw = min(min(kv_max_requests, 4096) / pp * (1 + isl / osl), 32768)
    if raw < 4096:
        return max(2048, 256 * math.ceil(raw / 256))
    if raw < 8192:
        return 512 * math.ceil(raw / 512)
    return 1024 * math.ceil(raw / 1024)


def max_batch_for(mem: RankMemory, *, isl: int, osl: int, pp: int = 1, limit: int = MAX_BATCH_LIMIT) -> int:
    """Sequences of isl + osl positions a dp rank's pool holds whole (whole blocks each), at
    most `limit` per pipeline micro-batch; 0 when not one fits."""
    blocks = math.ceil((isl + osl) / BLOCK_SIZE)
    fit = mem.kv_tokens // (blocks * BLOCK_SIZE)
    return int(min(fit, limit * pp))
