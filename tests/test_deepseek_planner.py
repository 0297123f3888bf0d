"""The planner's DeepSeek-V3: latent attention counted matrix by matrix and tensor by tensor,
the serving KV cache per token, and group-limited routing's smaller dispatch.

Exact figures where the architecture fixes them (parameters: the model built on the meta
device; 576 cached values per layer); monotone where the planner models a choice (fewer
groups per token, fewer bytes crossing nodes).
"""

from __future__ import annotations

from phalanx.model.by_name import model_config
from phalanx.planner import latent_attention
from phalanx.planner.cost import evaluate
from phalanx.planner.dispatch import copies_per_token
from phalanx.planner.hardware import PRESETS
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.memory import layer_activation_bytes, total_params

DSV3 = model_config("deepseek-v3")


def test_parameters_match_the_model_and_the_published_671b():
    from phalanx.model.init import build_model

    for name in ("deepseek-v3", "tiny-dsv3"):
        cfg = model_config(name)
        assert total_params(cfg) == sum(p.numel() for p in build_model(cfg).parameters()), name
    assert round(total_params(DSV3) / 1e9) == 671  # DeepSeek-V3 without its multi-token prediction module


def test_serving_kv_bytes_per_token_latent_against_heads():
    """576 values per token and layer (512 latent + 64 rotated key) against 128 heads x
    (192 key + 128 value) = 40,960 for the decompressed cache; GQA: kv heads x head_dim x 2."""
    assert DSV3.kv_cache_values_per_token == 576
    assert latent_attention.kv_cache_bytes_per_token(DSV3) == 61 * 576 * 2
    decompressed = DSV3.replace(kv_lora_rank=0, qk_rope_head_dim=0, qk_nope_head_dim=0, v_head_dim=0, q_lora_rank=0,
                                rope_type="default", head_dim=192, rope_interleave=False)
    assert decompressed.kv_cache_values_per_token == 128 * (192 + 192)  # GQA keeps v at head_dim
    llama = model_config("llama3-8b")
    assert latent_attention.kv_cache_bytes_per_token(llama) == 32 * 8 * 128 * 2 * 2


def test_latent_activations_are_the_decompressed_heads_split_over_tp():
    """Per layer and token, bf16: the decompressed q, k (192 each), v and attention output
    (128 each) of 128 heads, split by tp; the latents (2 x 1536 + 2 x 512 + 64) whole."""
    replicated, split = latent_attention.training_activation_bytes(DSV3, seq=1, mbs=1)
    assert split == 2 * 128 * (2 * 192 + 2 * 128) and replicated == 2 * (2 * 1536 + 2 * 512 + 64)
    one, two = (layer_activation_bytes(DSV3, seq=4096, mbs=1, tp=tp, sp=False, recompute="none", moe=False)
                for tp in (1, 2))
    mlp = 8 * 4096 * DSV3.ffn_dim  # a dense layer's SwiGLU, split by tp as well
    assert one - two == (split * 4096 + mlp) / 2


def test_dispatch_bytes_drop_as_topk_group_falls():
    """DeepSeek-V3 over 8 nodes of 8 GPUs (ep=64, a group of 32 experts per node): each token
    reaches at most topk_group nodes, so the planner's expert all-to-all time falls with it."""
    assert [copies_per_token(DSV3.replace(topk_groups=t), ep=64, local=8) for t in (8, 4, 2, 1)] == [8, 4, 2, 1]
    assert copies_per_token(DSV3, ep=8, local=8) == 8  # one node: nothing crosses the network anyway
    cluster, work = PRESETS["hgx-h800"], Workload(global_batch=1024, seq_len=4096)
    lay = Layout(dp=128, pp=16, ep=64, microbatches=8, mbs=1, schedule="1f1b", recompute="full", zero=1)
    ep_comm = [evaluate(DSV3.replace(topk_groups=t), cluster, work, lay).breakdown["ep_comm"] for t in (8, 4, 2, 1)]
    assert ep_comm[0] > ep_comm[1] > ep_comm[2] > ep_comm[3] > 0, ep_comm


def test_kv_values_per_token_layer_by_hand():
    """One tp rank's cache per token and layer (planner/kv_cache.py, which phalanx serve's paged
    cache also sizes by): Llama 3 8B's 8 KV heads of 128 keys and 128 values split over tp, one
    head each past 8 ranks; DeepSeek-V3's latent (512 + 64) whole on every rank."""
    from phalanx.planner.kv_cache import kv_bytes_per_token, kv_values_per_token_layer

    llama = model_config("llama3-8b")
    assert [kv_values_per_token_layer(llama, tp) for tp in (1, 2, 8, 16)] == [2048, 1024, 256, 256]
    assert kv_values_per_token_layer(DSV3, 1) == kv_values_per_token_layer(DSV3, 8) == 576
    assert kv_bytes_per_token(llama, bytes_per_value=1, tp=2, layers=3) == 3 * 1024
