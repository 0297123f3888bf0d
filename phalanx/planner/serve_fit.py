"""Fitting the serving engine's constants (serve_costs.ServeCosts) to measured steps,
torch-free. The measuring is phalanx/calibrate/serve_steps.py's.

Each measured step (decodes, mean context, prompt tokens, seconds) is explained as
  seconds = a x mechanical + step_s + sequences x sequence_s + decodes x layers x
            sequence_layer_s + tokens x token_s,
where `mechanical` is the step model's time of the step's FLOPs and bytes on the cluster
(framework costs off, scales 1); a is one factor on both rates (this CPU reaches some share
of the cluster's nominal FLOP rate and bandwidth; the two are not told apart by steps of
one model), so flops_scale = bandwidth_scale = 1 / a. The coefficients are non-negative
least squares on relative errors (every step weighs alike, short or long), solved by an
active set: fit, drop the most negative coefficient, fit again.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.model.config import ModelConfig
from phalanx.planner.hardware import Cluster
from phalanx.planner.serve_costs import ServeCosts
from phalanx.planner.serve_step import ServeLayout, step_time

NAMES = ("mechanical", "step_s", "sequence_s", "sequence_layer_s", "token_s")


@dataclass(frozen=True)
class MeasuredStep:
    decodes: int
    context: float
    prompt_tokens: int
    prompt_context: float
    seconds: float


def features(model: ModelConfig, cluster: Cluster, layout: ServeLayout, m: MeasuredStep) -> list[float]:
    none = ServeCosts()
    mech = step_time(model, cluster, layout, decodes=m.decodes, context=m.context, prefill_tokens=m.prompt_tokens,
                     prefill_context=m.prompt_context, costs=none).seconds
    sequences = m.decodes + (1 if m.prompt_tokens else 0)
    return [mech, 1.0, sequences, m.decodes * model.n_layers, m.decodes + m.prompt_tokens]


def _solve(rows: list[list[float]], target: list[float], active: list[int]) -> list[float]:
    """Least squares over the `active` columns (normal equations, Gaussian elimination)."""
    n = len(active)
    a = [[sum(r[i] * r[j] for r in rows) for j in active] for i in active]
    b = [sum(r[i] * t for r, t in zip(rows, target)) for i in active]
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(a[k][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        if abs(a[col][col]) < 1e-300:
            continue
        for k in range(n):
            if k != col:
                f = a[k][col] / a[col][col]
                a[k] = [x - f * y for x, y in zip(a[k], a[col])]
                b[k] -= f * b[col]
    return [b[i] / a[i][i] if abs(a[i][i]) > 1e-300 else 0.0 for i in range(n)]


def fit(model: ModelConfig, cluster: Cluster, steps: list[MeasuredStep], layout: ServeLayout) -> tuple[ServeCosts, float]:
    """The constants that explain `steps`, and the median relative error of the fit."""
    raw = [features(model, cluster, layout, m) for m in steps]
    rows = [[x / m.seconds for x in r] for r, m in zip(raw, steps)]  # relative: divide by the measured time
    target = [1.0] * len(steps)
    active = list(range(len(NAMES)))
    while True:
        coef = _solve(rows, target, active)
        worst = min(range(len(active)), key=lambda i: coef[i])
        if coef[worst] >= 0 or len(active) == 1:
            break
        active.pop(worst)
    values = dict.fromkeys(NAMES, 0.0)
    values.update({NAMES[i]: max(c, 0.0) for i, c in zip(active, coef)})
    a = values.pop("mechanical") or 1.0
    costs = ServeCosts(**values, flops_scale=1 / a, bandwidth_scale=1 / a)
    errors = sorted(abs(sum(c * x for c, x in zip([a, *values.values()], r)) / m.seconds - 1)
                    for r, m in zip(raw, steps))
    return costs, errors[len(errors) // 2]
