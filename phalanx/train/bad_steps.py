"""Steps whose loss or gradient norm is not finite are skipped (no optimizer update); too many
in a row stop the run. Both numbers are already reduced over every rank, so every rank takes
the same decision without another collective."""

from __future__ import annotations

import math


NAN_STEPS_ENV = "PHALANX_TEST_NAN_STEPS"
"""Test hook: comma-separated step numbers (1-based, as in metrics.jsonl) whose loss is made
NaN after the backward pass, so tests can drive the skip and stop logic on a healthy model; read by
`injected_faults.InjectedFaults.from_env`."""


def why_bad(loss: float, grad_norm: float) -> str | None:
    """The reason a step must be skipped, or None for a healthy one."""
    if not math.isfinite(loss):
        return f"loss is {loss}"
    if not math.isfinite(grad_norm):
        return f"gradient norm is {grad_norm}"
    return None


class BadStepCounter:
    """Counts skipped steps in a row; `bad` returns True when there are more than `limit`
    (the run may skip `limit` in a row and must stop at the next)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0

    def good(self) -> None:
        self.in_a_row = 0

    def bad(self) -> bool:
        self.in_a_row += 1
        return self.in_a_row > self.limit
