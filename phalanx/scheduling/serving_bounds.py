"""How large a serving load may be: the bounds `phalanx serve` and `phalanx plan --serve` check
their counts against, before any work.

MAX_POSITIONS (2^27): a request's prompt plus output, a step's token budget or a KV block's
length: the bound every model's context is held to (model/shape_bounds.py, `max_seq_len`).

MAX_SEQUENCES (2^24, 16.8 M): requests in flight. At that count even the largest preset
cluster (gb200-nvl72: 72 GPUs of 186 GiB, 13,392 GiB of HBM) holds under 1 MiB of KV cache per
request, about 6 positions of Llama-3-8B (128 KiB per position: 32 layers x 8 KV heads x 128
channels x keys and values x 2 bytes).
"""

from __future__ import annotations

from phalanx.errors import UserError
from phalanx.model.shape_bounds import LIMITS

MAX_POSITIONS = LIMITS["max_seq_len"]
MAX_SEQUENCES = 2**24


def check_counts(**counts: int | None) -> None:
    """Each flag's count (flag name with underscores -> value) within its bound; names ending
    in `seqs` or `concurrency` count sequences, the others positions."""
    for name, value in counts.items():
        if value is None:
            continue
        sequences = name.endswith(("seqs", "concurrency"))
        bound, what = (MAX_SEQUENCES, "requests in flight") if sequences else (MAX_POSITIONS, "positions")
        if value > bound:
            flag = "--" + name.replace("_plus_", " + --").replace("_", "-")
            raise UserError(f"{flag}={value} is beyond {bound:,} {what}, the bound of any serving load "
                            "(phalanx/scheduling/serving_bounds.py says why)")
