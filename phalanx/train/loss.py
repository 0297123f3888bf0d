"""The training loss every layout computes: mean next-token cross-entropy.

One function for the flat loop, the pipeline schedules' last stage, calibration and the
benchmarks, so that no layout can drift to another definition.
"""

import torch
import torch.nn.functional as F


def token_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (logits may be vocab-sharded)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
