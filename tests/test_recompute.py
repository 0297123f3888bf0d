"""Activation checkpointing replays the right work in backward.

Losses with recompute=full/selective match one process exactly (test_hybrid_layouts.py); here
we check that the setting does something, by counting ops run during backward:
- none: backward runs only gradient kernels (no forward `silu`, 2 matrix products per matrix);
- full: each block's forward is replayed (forward `silu` appears, one more product per matrix);
- selective: only the attention core's forward is replayed (Korthikanti et al.'s selective
  recomputation): no forward `silu`, no extra product, one attention forward per layer.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from phalanx.model.by_name import model_config
from phalanx.parallel.apply import parallelize
from phalanx.parallel.mesh import build_mesh
from phalanx.plan import Plan


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(recompute: str) -> Counter:
    cfg = model_config("tiny")
    model = parallelize(cfg, build_mesh(Plan(recompute=recompute), torch.device("cpu")), seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(tokens).float().square().mean()
    with _CountOps() as mode:
        loss.backward()
    return mode.counts


@pytest.fixture(scope="module")
def counts():
    return {mode: _backward_ops(mode) for mode in ("none", "selective", "full")}


def test_full_replays_the_block_forward(counts):
    assert counts["none"]["silu"] == 0
    assert counts["full"]["silu"] == 4  # one SwiGLU per layer, 4 layers
    assert counts["full"]["mm"] > counts["none"]["mm"]


def _attention_forwards(counts: Counter) -> int:
    return sum(n for name, n in counts.items() if name.startswith("_scaled_dot_product") and "backward" not in name)


def test_selective_replays_only_the_attention_core(counts):
    assert _attention_forwards(counts["none"]) == 0
    assert _attention_forwards(counts["selective"]) == 4  # one per layer
    assert counts["selective"]["silu"] == 0
    assert counts["selective"]["mm"] == counts["none"]["mm"]
