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

from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.host_syncs import moe_layer_host_reads


def test_one_process_reads_nothing():
    assert moe_layer_host_reads(1) == {}


def test_expert_parallel_reads_split_sizes_once_per_layer():
    for reads in run_ranks(2, moe_layer_host_reads, 2):
        assert reads == {"tolist": 1}
