"""Fitting the serving engine's constants (serve/costs.ServeCosts) to measured steps, and then
to latencies measured through a real server (`fit_probe`), torch-free. The measuring is
phalanx/calibrate/serve_steps.py's and serve_probe.py's.

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

import dataclasses
from dataclasses import dataclass

from phalanx.model.config import ModelConfig
from phalanx.planner.hardware import Cluster
from phalanx.planner.serve.costs import ServeCosts
from phalanx.planner.serve.rates import ServeLoad
from phalanx.planner.serve.search import evaluate
from phalanx.planner.serve.step import ServeLayout, step_time

NAMES = ("mechanical", "step_s", "sequence_s", "sequence_layer_s", "token_s")


@dataclass(frozen=True)
class MeasuredStep:
    decodes: int
    context: float
    prompt_tokens: int
    prompt_context: float
    seconds: float


def compute_world(cluster: Cluster, processes: int, threads: int = 0) -> int:
    """The `world` a process's share of a shared CPU node is figured for (serve/step.step_time:
    the node's rate divided among `world` ranks): the node's cores divide among the
    processes, and a process of `threads` threads (0: its automatic share, cores / processes)
    uses at most that many of them. One process of one thread on 2 cores computes at a
    core's rate (world 2), not the node's; 4 single-threaded processes on 2 cores at half a
    core's (world 4)."""
    if not cluster.shared_compute or threads <= 0:
        return processes
    return max(processes, cluster.devices_per_node // threads, 1)


def features(model: ModelConfig, cluster: Cluster, layout: ServeLayout, m: MeasuredStep,
             world: int | None = None) -> list[float]:
    none = ServeCosts()
    mech = step_time(model, cluster, layout, decodes=m.decodes, context=m.context, prefill_tokens=m.prompt_tokens,
                     prefill_context=m.prompt_context, world=world, costs=none).seconds
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


def fit(model: ModelConfig, cluster: Cluster, steps: list[MeasuredStep], layout: ServeLayout, *,
        split_forwards: bool = True, world: int | None = None) -> tuple[ServeCosts, float]:
    """The constants that explain `steps` (each one forward: decodes alone or a prompt alone),
    and the median relative error of the fit. `split_forwards`: whether the engine whose steps
    these are runs decodes and prompt chunks as two forwards (calibrate asks the engine:
    calibrate/serve_steps.engine_splits_forwards; phalanx serve's does). `world`: the share of
    the node the timing process had (`compute_world` of its thread count; None: the layout's)."""
    raw = [features(model, cluster, layout, m, world) for m in steps]
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
    costs = ServeCosts(**values, flops_scale=1 / a, bandwidth_scale=1 / a, split_forwards=split_forwards)
    errors = sorted(abs(sum(c * x for c, x in zip([a, *values.values()], r)) / m.seconds - 1)
                    for r, m in zip(raw, steps))
    return costs, errors[len(errors) // 2]


# What the engine's steps alone do not show, from a real server (phalanx/calibrate/serve_probe.py)

@dataclass(frozen=True, kw_only=True)
class ServerProbe:
    """Median latencies measured through a real `phalanx serve` of `tp` ranks."""
    tp: int
    isl: int
    osl: int
    max_num_seqs: int
    max_batch_tokens: int
    ttft_s: float
    """Requests sent one at a time."""
    tpot_s: float
    burst: int = 0
    """Requests sent at once for the second point (0: none, as under tp > 1)."""
    burst_tpot_s: float = 0.0
    threads: int = 0
    """Threads per server process (0: `phalanx serve`'s automatic count, cores / processes)."""


def predicted_latency(model: ModelConfig, cluster: Cluster, costs: ServeCosts, probe: ServerProbe, *,
                      burst: bool = False) -> tuple[float, float]:
    """The planner's (TTFT, TPOT p50) for the probe's requests: one at a time (a vanishing
    Poisson rate) or, TPOT only, `probe.burst` sent at once: their prompts run in the first
    steps, then every step decodes all of them and nothing else, so a step of `burst` decodes
    (not the planner's closed loop, whose steps also carry the next requests' prompts)."""
    layout = ServeLayout(tp=probe.tp, weight_dtype="fp32", kv_dtype="fp32")
    world = compute_world(cluster, probe.tp, probe.threads)
    if burst:
        return 0.0, step_time(model, cluster, layout, decodes=probe.burst, context=probe.isl + probe.osl / 2,
                              world=world, costs=costs).seconds
    load = ServeLoad(isl=probe.isl, osl=probe.osl, rate=1e-3)
    plan = evaluate(model, cluster, layout, 1, load, max_batch=probe.max_num_seqs,
                    max_batch_tokens=probe.max_batch_tokens, world=world, costs=costs)
    return plan.rates.ttft_s, plan.rates.tpot_p50_s


def _newton(predict, measured: list[float], x: list[float], rounds: int = 6) -> list[float]:
    """x with predict(x) == measured (one or two unknowns; finite-difference Jacobian). The
    predictions are nearly linear in the costs (the batch under a vanishing rate moves a
    little with the step time), so a few rounds settle it."""
    h = 1e-5
    for _ in range(rounds):
        f = predict(x)
        r = [m - v for m, v in zip(measured, f)]
        jac = [[(predict([*x[:j], x[j] + h, *x[j + 1:]])[i] - f[i]) / h for j in range(len(x))]
               for i in range(len(x))]
        if len(x) == 1:
            dx = [r[0] / jac[0][0]] if jac[0][0] else [0.0]
        else:
            det = jac[0][0] * jac[1][1] - jac[0][1] * jac[1][0]
            if not det:
                return x
            dx = [(r[0] * jac[1][1] - jac[0][1] * r[1]) / det, (jac[0][0] * r[1] - jac[1][0] * r[0]) / det]
        x = [a + d for a, d in zip(x, dx)]
    return x


def fit_probe(model: ModelConfig, cluster: Cluster, costs: ServeCosts, probe: ServerProbe) -> ServeCosts:
    """`costs` (the engine steps' fit) with what the server adds, so that the planner predicts
    the probe's own latencies (each added cost clipped at 0: where the steps already explain
    more than was measured, the prediction stays above it):

    - one process: per step and per sequence (streaming each sequence's token through the
      server's thread each step), from the TPOT of one request and of `burst` at once;
      then per request (the HTTP path to the first token), from the TTFT of one;
    - tp > 1: the group's cost per step (rank 0 broadcasting each forward, the gathered logits,
      collectives waiting for every rank on shared cores), from the TPOT of one request."""
    replace = dataclasses.replace
    tpot = lambda c, burst=False: predicted_latency(model, cluster, c, probe, burst=burst)[1]  # noqa: E731
    if probe.tp == 1:
        with_step = lambda x: replace(costs, step_s=costs.step_s + x[0],  # noqa: E731
                                      sequence_s=costs.sequence_s + (x[1] if len(x) > 1 else 0.0))
        step = seq = 0.0
        if probe.burst > 1:
            step, seq = _newton(lambda x: [tpot(with_step(x)), tpot(with_step(x), True)],
                                [probe.tpot_s, probe.burst_tpot_s], [0.0, 0.0])
        if probe.burst <= 1 or seq < 0 or step < 0:  # then per step alone, from one request
            seq = 0.0
            step = _newton(lambda x: [tpot(with_step([x[0], seq]))], [probe.tpot_s], [0.0])[0]
        costs = with_step([max(step, 0.0), seq])
        request = _newton(lambda x: [predicted_latency(model, cluster, replace(costs, request_s=x[0]), probe)[0]],
                          [probe.ttft_s], [0.0])[0]
        return replace(costs, request_s=max(request, 0.0))
    others = tuple(row for row in costs.group_step_s if row[0] != probe.tp)
    grouped = lambda x: replace(costs, group_step_s=tuple(sorted(others + ((probe.tp, x[0]),))))  # noqa: E731
    group = _newton(lambda x: [tpot(grouped(x))], [probe.tpot_s], [0.0])[0]
    return grouped([max(group, 0.0)])
