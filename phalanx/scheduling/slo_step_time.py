"""How long a model step takes, for the SLO scheduler (`slo_policy.py`): a small interface and
an online fit, plain Python (no torch), so it runs on a simulated clock in tests.

A step's time depends on its shape: how many sequences decode (one token each: on a GPU each
costs little compute but reads its keys and values), how many prompt tokens are prefilled (the
compute of the step), and how many keys all of them attend to (the KV cache read). The
scheduler asks a `StepTimePredictor` what a candidate shape would take, and tells it what each
step really took. Any model of the hardware can stand behind the interface (the serving planner's
step model, once it exists, is one); `OnlineStepFit` learns one from the measured steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StepShape:
    decodes: int
    """Sequences feeding one token (decoding)."""
    prefill_tokens: int
    """Prompt tokens fed in chunks (the rest of the step's tokens)."""
    context_tokens: int
    """Keys and values the step's tokens attend to, summed over its sequences."""

    def features(self) -> tuple[float, ...]:
        # 1 for the fixed cost of a step (launches, the Python around the forward, sampling).
        return (1.0, float(self.decodes), float(self.prefill_tokens), float(self.context_tokens))


def step_shape(step) -> StepShape:
    """The shape of a scheduled `scheduler.Step`."""
    decodes = sum(1 for chunk in step.chunks if chunk.length == 1)
    prefill = sum(chunk.length for chunk in step.chunks if chunk.length > 1)
    context = sum(chunk.start + chunk.length for chunk in step.chunks)
    return StepShape(decodes, prefill, context)


class StepTimePredictor(Protocol):
    def predict(self, shape: StepShape) -> float:
        """Seconds a step of this shape takes."""

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step of this shape took `seconds` (measured)."""


@dataclass(frozen=True)
class StepPrior:
    """Seconds per step, per decoding sequence, per prefilled token, per attended key: where
    the fit starts, and how far it leans on that before data comes (`weight`, in steps)."""
    base_s: float = 0.01
    per_decode_s: float = 0.001
    per_prefill_token_s: float = 0.0005
    per_context_token_s: float = 0.0
    weight: float = 0.01

    def coefficients(self) -> list[float]:
        return [self.base_s, self.per_decode_s, self.per_prefill_token_s, self.per_context_token_s]


class OnlineStepFit:
    """A linear step-time model, time = base + a * decodes + b * prefill tokens + c * keys, fit
    by recursive least squares with forgetting (`memory` steps, about), so it follows a device
    whose speed drifts (a shared machine, clocks, another process). The prior acts as
    `prior.weight` pseudo-observations: a weak start that the first measured steps overrule.
    Coefficients are kept >= 0 when predicting (a step never gets faster with more work)."""

    def __init__(self, prior: StepPrior = StepPrior(), memory: float = 200.0):
        self.forget = 1.0 - 1.0 / memory
        self.coef = prior.coefficients()
        # The inverse information matrix: a diagonal scaled so that each feature's prior
        # counts as `weight` steps at a typical size of that feature.
        typical = (1.0, 8.0, 256.0, 2048.0)
        self.cov = [[(1.0 / (prior.weight * t * t) if i == j else 0.0) for j, t in enumerate(typical)]
                    for i in range(len(typical))]
        self.observed = 0
        self._cov_cap = [self.cov[i][i] for i in range(len(typical))]

    def predict(self, shape: StepShape) -> float:
        return max(0.0, sum(max(0.0, c) * x for c, x in zip(self.coef, shape.features())))

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = shape.features()
        n = len(x)
        px = [sum(self.cov[i][j] * x[j] for j in range(n)) for i in range(n)]
        denominator = self.forget + sum(x[i] * px[i] for i in range(n))
        gain = [v / denominator for v in px]
        error = seconds - sum(c * v for c, v in zip(self.coef, x))
        self.coef = [c + g * error for c, g in zip(self.coef, gain)]
        self.cov = [[(self.cov[i][j] - gain[i] * px[j]) / self.forget for j in range(n)] for i in range(n)]
        # Forgetting inflates the uncertainty of what the steps do not vary (hours of decode-only
        # steps say nothing new about prefill): capped at the prior's, it stays finite.
        scale = [min(1.0, (self._cov_cap[i] / self.cov[i][i]) ** 0.5) if self.cov[i][i] > 0 else 1.0 for i in range(n)]
        self.cov = [[self.cov[i][j] * scale[i] * scale[j] for j in range(n)] for i in range(n)]
        self.observed += 1
