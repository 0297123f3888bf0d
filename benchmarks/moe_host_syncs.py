"""Host reads (synchronizations on a GPU) per MoE layer per micro-batch, forward + backward.

Counts the Tensor methods that read values on the host (`phalanx.testing.host_syncs`) over
one training forward and backward of a tiny-moe layer, in one process and on 2 gloo ranks
with ep=2, after a warm-up call. Run it in any checkout to compare code versions:

    PYTHONPATH=. python benchmarks/moe_host_syncs.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phalanx.testing.fork_ranks import run_ranks  # noqa: E402


def _reads(ep: int) -> dict:
    import torch
    import torch.distributed as dist

    from phalanx.model.config import model_config
    from phalanx.model.moe import MoE
    from phalanx.parallel.expert import shard_experts
    from phalanx.testing.host_syncs import count_host_reads

    torch.manual_seed(0)
    moe = MoE(model_config("tiny-moe"))
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.1)
    if ep > 1:
        moe.experts = shard_experts(moe.experts, dist.group.WORLD, dist.get_rank(), ep)
    tokens = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    moe(tokens).square().sum().backward()  # warm-up: the grouped-matmul check reads values once
    with count_host_reads() as reads:
        moe(tokens).square().sum().backward()
    return dict(reads)


def main() -> None:
    one = run_ranks(1, _reads, 1)[0]
    ep2 = run_ranks(2, _reads, 2)
    print(json.dumps({"one_process": one, "ep2_per_rank": ep2,
                      "ep2_reads_per_layer": max(sum(r.values()) for r in ep2)}))


if __name__ == "__main__":
    main()
