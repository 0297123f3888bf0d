"""Under `--dtype bf16` expert parallelism sends bf16 rows and trains as one process does.

Tolerance. Routing is computed in fp32 from the same weights, so tokens go to the same experts
(a flip would show as a large difference). What differs is rounding: an expert's matmul sees
its rows from both ranks in another grouping, and its weight gradient, a bf16 matmul output,
is summed in another order; one bf16 rounding is 2^-9 ~ 2e-3 relative. Through AdamW's
m / sqrt(v) such a change moves an element's step by at most about lr = 3e-3 (where a
gradient near zero changes sign), so after 3 steps weights may differ by up to ~1e-2 (they
are O(0.02-1)); WEIGHT_TOLERANCE = 2e-2 absolute. The losses (fp32 cross-entropy of bf16
logits, ~5.5) move by far less: LOSS_TOLERANCE = 1e-2, about a third of one bf16 step (2^-5)
at that size, so a loss rounded or computed differently by a whole bf16 step would fail.
A real bug (an expert gradient divided by edp, a token at the wrong expert) changes weights
by far more than lr per step and the loss beyond 1e-2 within the three steps.
"""

from __future__ import annotations

from pathlib import Path

import torch

from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.weights import gathered_weights

LOSS_TOLERANCE = 1e-2
WEIGHT_TOLERANCE = 2e-2


def _run(cfg):
    """Train, recording the dtype of every row tensor (2-D) that an all-to-all moves."""
    import torch.distributed as dist

    from phalanx.train.loop import train

    sent, original = set(), dist.all_to_all_single

    def recording(output, input, *args, **kwargs):
        if input.dim() == 2:
            sent.add(input.dtype)
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = recording
    try:
        result = train(cfg, Path(cfg.out))
    finally:
        dist.all_to_all_single = original
    return result.losses, gathered_weights(result.model), sent


def test_bf16_dispatch_matches_one_process(tiny_config):
    cfg = tiny_config.replace(model="tiny-moe", steps=3, dtype="bf16")
    ref_losses, ref_weights, _ = run_ranks(1, _run, cfg.replace(out=cfg.out + "-ref"))[0]
    results = run_ranks(2, _run, cfg.replace(plan="dp=2,ep=2"))
    for losses, weights, sent in results:
        assert sent == {torch.bfloat16}  # rows travel (both ways, forward and backward) in bf16
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < LOSS_TOLERANCE, (losses, ref_losses)
        for name, value in weights.items():
            torch.testing.assert_close(value, ref_weights[name], atol=WEIGHT_TOLERANCE, rtol=0, msg=name)
