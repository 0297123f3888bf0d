"""Data parallelism on a one-rank NCCL group: FSDP2 (zero=3), DDP, and FSDP2 with its shards
offloaded to pinned host memory, each against the plain model on the same GPU.

The trainer only wraps a model in FSDP2 or DDP from dp=2 on, which needs two GPUs; on one GPU
the wrappers are applied by hand (`apply_fsdp`, `apply_ddp`, the trainer's own functions) over
a one-rank mesh. What runs is what several ranks run: FSDP2's all-gather and reduce-scatter,
DDP's bucketed all-reduce, and the offload's host-device copies, through NCCL. Over one rank
a collective copies and divides by 1, so the arithmetic is the plain model's; the tolerance,
1e-5 relative on losses and gradient norms and absolute on weights (values ~0.1 to 5) after
3 fp32 steps, leaves room only for CUDA kernels that do not sum in a fixed order between two
calls (attention's backward). A doubled reduction doubles the gradient norm (clipping and
AdamW would hide it in the weights); a shard put back in the wrong place moves weights by
whole values; a lost offload copy leaves them unchanged by the step (lr = 3e-3 away).
"""

from __future__ import annotations

import pytest
import torch

from phalanx.model.by_name import model_config
from phalanx.model.init import build_model
from phalanx.parallel.materialize import materialize
from phalanx.plan import Plan
from tests.cuda_reference import CUDA_ONLY, assert_same_run, nccl_group, one_rank_mesh, train_steps

pytestmark = CUDA_ONLY
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference():
    """The plain model (no wrapper, no process group) on the GPU, fp32."""
    cfg = model_config("tiny")
    device = torch.device("cuda", 0)
    return train_steps(materialize(build_model(cfg), cfg, 0, device), cfg.vocab_size, device)


def test_fsdp2_on_one_nccl_rank_equals_the_plain_model(reference):
    from phalanx.parallel.data_parallel import apply_fsdp

    cfg, device = model_config("tiny"), torch.device("cuda", 0)
    with nccl_group():
        mesh = one_rank_mesh(Plan(dp=1, zero=3), device)
        model = materialize(apply_fsdp(build_model(cfg), mesh), cfg, 0, device)
        got = train_steps(model, cfg.vocab_size, device)
    assert_same_run(got, reference, TOLERANCE)


def test_ddp_on_one_nccl_rank_equals_the_plain_model(reference):
    from phalanx.parallel.data_parallel import apply_ddp

    cfg, device = model_config("tiny"), torch.device("cuda", 0)
    with nccl_group():
        mesh = one_rank_mesh(Plan(dp=1), device)
        model = apply_ddp(materialize(build_model(cfg), cfg, 0, device), mesh)
        got = train_steps(model, cfg.vocab_size, device)
    assert_same_run(got, reference, TOLERANCE)


def test_offload_keeps_the_shards_in_pinned_host_memory(reference):
    """offload=true on CUDA asks FSDP2 for pinned host shards (`fsdp_options`); the weights are
    materialized on the GPU as the trainer does and FSDP2 moves them at its first forward."""
    from torch.distributed.tensor import DTensor

    from phalanx.parallel.data_parallel import apply_fsdp

    cfg, device = model_config("tiny"), torch.device("cuda", 0)
    with nccl_group():
        mesh = one_rank_mesh(Plan(dp=1, zero=3, offload=True), device)
        model = materialize(apply_fsdp(build_model(cfg), mesh), cfg, 0, device)
        got = train_steps(model, cfg.vocab_size, device)
        shards = [p.to_local() for p in model.parameters() if isinstance(p, DTensor)]
        assert shards and len(shards) == len(list(model.parameters()))
        assert all(s.device.type == "cpu" and s.is_pinned() for s in shards)
    assert_same_run(got, reference, TOLERANCE)
