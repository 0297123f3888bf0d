"""Count the Python-visible reads of tensor values by the host (tests and benchmarks).

On a GPU each such read (`tolist`, `item`, `int(t)`, `float(t)`, `bool(t)`, `.cpu()`,
`.numpy()`) waits for the device: a host synchronization. Counting the calls finds them on
CPU too, where nothing waits. What it cannot see are reads inside C++ kernels (CUDA
`torch.bincount` reading its largest input, `repeat_interleave` without `output_size`,
boolean-mask indexing); code under test must avoid those by construction.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch
import torch.distributed as dist

from phalanx.model.by_name import model_config
from phalanx.model.moe import MoE
from phalanx.parallel.expert import shard_experts

_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def count_host_reads() -> Iterator[Counter]:
    """Within the block, count calls of each host-reading Tensor method (by name)."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(name, original):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def moe_layer_host_reads(ep: int) -> dict:
    """Host reads of one training forward + backward of a tiny-moe layer, after a warm-up call
    (the first call checks the grouped-matmul kernel once per device and dtype, which reads
    values); with ep > 1, on this gloo rank of an ep group over the whole world."""
    torch.manual_seed(0)
    moe = MoE(model_config("tiny-moe"))
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.1)
    rank = dist.get_rank() if ep > 1 else 0
    if ep > 1:
        moe.experts = shard_experts(moe.experts, dist.group.WORLD, rank, ep)
    tokens = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1 + rank))
    moe(tokens).square().sum().backward()  # warm-up
    with count_host_reads() as reads:
        moe(tokens).square().sum().backward()
    return dict(reads)
