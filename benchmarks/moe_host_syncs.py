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
from phalanx.testing.host_syncs import moe_layer_host_reads  # noqa: E402


def main() -> None:
    one = run_ranks(1, moe_layer_host_reads, 1)[0]
    ep2 = run_ranks(2, moe_layer_host_reads, 2)
    print(json.dumps({"one_process": one, "ep2_per_rank": ep2,
                      "ep2_reads_per_layer": max(sum(r.values()) for r in ep2)}))


if __name__ == "__main__":
    main()
