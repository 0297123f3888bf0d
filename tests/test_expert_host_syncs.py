"""How often an MoE layer reads tensor values on the host (a synchronization on a GPU).

Counted by patching the Tensor methods that read values (`phalanx.testing.host_syncs`),
over one training forward and backward of an MoE layer, after a warm-up call (the first call
checks the grouped-matmul kernel once per device and dtype, which reads values). Exact
integers, no tolerance. Under expert parallelism a dispatch must read its split sizes once
(they are Python lists for all_to_all_single) and reuse them for combine and both backward
all-to-alls; before this was fixed it read them three times per layer per micro-batch
(`benchmarks/moe_host_syncs.py` prints the figure for any checkout). One process reads
nothing at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.model.config import model_config
from phalanx.model.moe import MoE
from phalanx.parallel.expert import shard_experts
from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.host_syncs import count_host_reads


def _layer(ep: int) -> MoE:
    torch.manual_seed(0)
    moe = MoE(model_config("tiny-moe"))
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.1)
    if ep > 1:
        moe.experts = shard_experts(moe.experts, dist.group.WORLD, dist.get_rank(), ep)
    return moe


def _reads_per_step(ep: int) -> dict:
    moe = _layer(ep)
    tokens = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1 + (dist.get_rank() if ep > 1 else 0)))
    moe(tokens).square().sum().backward()  # warm-up: the kernel check reads values once
    with count_host_reads() as reads:
        moe(tokens).square().sum().backward()
    return dict(reads)


def test_one_process_reads_nothing():
    assert _reads_per_step(1) == {}


def test_expert_parallel_reads_split_sizes_once_per_layer():
    for reads in run_ranks(2, _reads_per_step, 2):
        assert reads == {"tolist": 1}
