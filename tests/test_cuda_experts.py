"""Expert-parallel dispatch on one NCCL rank: `tiny-moe` with every MoE layer's experts
replaced by the ep rank's block (`shard_experts`, as `apply_ep` does at ep > 1), so each
layer's rows go through the all-to-all dispatch and combine over NCCL, against the same
model with its local experts, on the same GPU.

Over one rank the all-to-alls copy the rows, and the experts see them in the same order, so
the tolerance is the data-parallel tests' (1e-5 relative on losses and gradient norms,
absolute on weights, after 3 fp32 steps: CUDA kernels that sum in no fixed order). A wrong
split of the send and receive sizes drops or mixes rows, which moves the loss at the first step.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from phalanx.model.by_name import model_config
from phalanx.model.init import build_model
from phalanx.model.moe import GroupedExperts
from phalanx.parallel.materialize import materialize
from tests.cuda_reference import CUDA_ONLY, assert_same_run, nccl_group, train_steps

pytestmark = CUDA_ONLY


def test_dispatch_over_one_nccl_rank_equals_local_experts():
    from phalanx.parallel.expert import ShardedExperts, shard_experts

    cfg, device = model_config("tiny-moe"), torch.device("cuda", 0)
    local = materialize(build_model(cfg), cfg, 0, device)
    dispatched = copy.deepcopy(local)
    with nccl_group():
        found = [(name, module) for name, module in dispatched.named_modules() if isinstance(module, GroupedExperts)]
        assert found
        for name, full in found:
            parent, _, leaf = name.rpartition(".")
            setattr(dispatched.get_submodule(parent), leaf, shard_experts(full, dist.group.WORLD, 0, 1))
        assert sum(isinstance(m, ShardedExperts) for m in dispatched.modules()) == len(found)
        got = train_steps(dispatched, cfg.vocab_size, device)
    assert_same_run(got, train_steps(local, cfg.vocab_size, device), 1e-5)
