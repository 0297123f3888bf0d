"""`--kv-cache-memory` sizes the block pool from what the cache really allocates per block:
grouped-query attention's keys and values of this rank's kv heads, latent attention's latent
and rotated key (one pair for all heads: for DeepSeek-V3 576 values per position and layer,
where per-head keys and values would be 40,960). Counted against the tensors a prefill makes
the paged cache allocate."""

from __future__ import annotations

import pytest
import torch

from phalanx.model.by_name import model_config
from phalanx.model.init import build_model, init_weights
from phalanx.serve.paged_cache import ChunkLayout, PagedKVCache, bytes_per_block, kv_channels_per_position


@pytest.mark.parametrize("name", ["tiny", "tiny-kv4", "tiny-dsv3"])
def test_bytes_per_block_is_what_a_prefill_allocates(name):
    cfg = model_config(name)
    model = init_weights(build_model(cfg), cfg, seed=0, device="cpu").eval()
    cache = PagedKVCache(num_blocks=3, block_size=4)
    cache.prepare([ChunkLayout([2, 0], 0, 6)])
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, 6)), cache)
    allocated = sum(t.numel() * t.element_size() for t in cache.pools.values())
    assert allocated == 3 * bytes_per_block(4, cfg.n_layers, kv_channels_per_position(cfg), 4)

