"""What one serving layout delivers under a load: TTFT, TPOT p50/p99, tokens/s per GPU and
goodput, from the step model (serve/step.py), in closed form so that the search stays under a
second (the discrete-event simulator, serve/simulate.py, checks these on a trace).

Colocated prefill and decode (chunked prefill, decodes first, as phalanx serve, vLLM and
SGLang schedule): in steady state a dp rank running B sequences makes one token for each per
step, so requests finish at B / (osl s) per second and their prompts add P = B isl / osl
prompt tokens to every step (at most the step's token budget less the decodes: past that the
running batch cannot be kept full). The step time s = step(B decodes at mean context
isl + osl/2, P prompt tokens) is the TPOT; a new prompt runs in ceil(isl / budget) chunks of
steps carrying the decodes (TTFT, after half a step's wait for the running one).
Under `--rate` the running batch follows from Little's law, B = lambda (osl s(B) + TTFT),
solved by iteration (overload when it exceeds max_batch); the wait for the step's prompt
budget is M/D/1's rho / (2 (1 - rho)) steps; TPOT p99 is the step of a request whose lifetime
saw the 99th percentile of Poisson arrivals (mean + 2.33 sd) of prompts. Under
`--concurrency` requests beyond the seats wait for them. Goodput: requests/s that meet both
targets (DistServe): the arrival rate (or the closed loop's completion rate) times the share
of requests within them (TPOT between p50 and p99 interpolated), 0 past overload.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from phalanx.model.config import ModelConfig
from phalanx.planner.hardware import Cluster
from phalanx.planner.serve.costs import ServeCosts
from phalanx.planner.serve.expert_load import ExpertLoad
from phalanx.planner.serve.step import ServeLayout, step_time

Z99 = 2.326
"""Standard normal 99th percentile."""


@dataclass(frozen=True, kw_only=True)
class ServeLoad:
    """The workload of a serving plan: lengths, the load (one of concurrency or rate, or
    neither: as many requests as the KV cache holds), the targets (ms), the phase rated."""
    isl: int
    osl: int
    concurrency: int | None = None
    rate: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    phase: str = "both"
    expert_load: ExpertLoad | None = None
    """How unevenly the requests' tokens pick the routed experts (`--expert-load`); None: evenly."""


@dataclass(frozen=True, kw_only=True)
class Rates:
    batch: float
    """Sequences running per dp rank."""
    ttft_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    output_tps_gpu: float
    input_tps_gpu: float
    goodput: float
    """Requests/s within both targets (all requests when none is set), whole deployment."""
    overloaded: bool = False
    breakdown: dict[str, float] = field(default_factory=dict)
    """The decode step's seconds by cause (serve/step.StepTime)."""


@dataclass(frozen=True)
class Setting:
    model: ModelConfig
    cluster: Cluster
    layout: ServeLayout
    costs: ServeCosts
    world: int
    """Devices sharing compute (one CPU node: all of them)."""
    max_batch: int
    max_batch_tokens: int

    def step(self, batch: float, prompt_tokens: float, load: ServeLoad, shares: tuple[float, float] = (1.0, 1.0)):
        """One step of `batch` decodes and `prompt_tokens` prompt tokens on a dp rank, through
        all pp stages (each stage a 1/pp micro-batch); `shares`: serve/step.step_time's."""
        pp = self.layout.pp
        st = step_time(self.model, self.cluster, self.layout, decodes=batch / pp, context=load.isl + load.osl / 2,
                       prefill_tokens=prompt_tokens / pp, prefill_context=load.isl / 2, world=self.world,
                       costs=self.costs, shares=shares)
        return pp * st.seconds, {k: pp * v for k, v in st.breakdown.items()}


def _share_within(target: float | None, p50: float, p99: float) -> float:
    """Share of requests whose latency is within `target`, from its p50 and p99."""
    if target is None or p99 <= target:
        return 1.0
    if target < p50:
        return 0.0
    return 0.5 + 0.49 * (target - p50) / max(p99 - p50, 1e-12)


def colocated(s: Setting, load: ServeLoad, *, ranks: int, gpus: int) -> Rates:
    """Rates of `ranks` dp ranks (all instances) on `gpus` devices, prefill and decode sharing
    each step."""
    isl, osl, mbt = load.isl, load.osl, s.max_batch_tokens

    def steady(b: float, extra_prompts: float = 0.0):
        """(step seconds, TTFT, step breakdown) at a running batch of b: a new prompt waits
        half a step for the running one to end (if one runs), then runs in chunks of the budget the
        decodes leave, each chunk's step carrying the decodes too."""
        room = max(mbt - b, 1.0)
        prompt = min(b * isl / osl + extra_prompts, room)
        chunk = min(float(isl), room)
        # Under an engine that splits them (ServeCosts.split_forwards), a decoding request's
        # step holds a prompt forward when at least one of the prompt / chunk arriving per
        # step on average (as Poisson counts) came: in 1 - exp(-prompt / chunk) of the steps,
        # several together in one forward; a prompt's first step holds the decodes' forward
        # when at least one of the b running sequences decodes: 1 - exp(-b).
        sec, parts = s.step(b, prompt, load, shares=(1.0, -math.expm1(-prompt / chunk)))
        chunk_sec, _ = s.step(b, max(chunk, prompt), load, shares=(-math.expm1(-b), 1.0))
        # The wait for the running step: half a step, when one is running (some of the b
        # sequences decoding, 1 - exp(-b); an idle engine starts the prompt at once).
        busy = -math.expm1(-b)
        return sec, s.costs.request_s + 0.5 * busy * sec + math.ceil(isl / room) * chunk_sec, parts

    def sustainable(b: float) -> float:
        """Running batch the step's prompt budget can keep full: b isl / osl <= mbt - b."""
        return min(b, mbt * osl / (isl + osl))

    cap = float(s.max_batch)
    overloaded = False
    if load.rate is not None:
        lam = load.rate / ranks
        b = 1.0
        for _ in range(60):
            sec, ttft, _ = steady(min(b, cap))
            new = lam * (osl * sec + ttft)
            if abs(new - b) < 1e-3 * max(b, 1.0):
                b = new
                break
            b = new
        if b > sustainable(cap) or not math.isfinite(b):
            overloaded, b = True, sustainable(cap)
        sec, ttft, parts = steady(b)
        rho = min(lam * isl * sec / max(mbt - b, 1.0), 0.999)
        ttft += rho / (2 * (1 - rho)) * sec
        arrivals = lam * osl * sec
        extra = Z99 * math.sqrt(arrivals) * isl / osl if arrivals > 0 else 0.0
        p99 = max(steady(b, extra)[0], sec)  # (the GEMMs' wave quantization is not monotone in the rows)
        served = lam * ranks if not overloaded else ranks * b / (osl * sec + ttft)
        share = _share_within(load.tpot_ms and load.tpot_ms / 1e3, sec, p99)
        if load.ttft_ms is not None and (ttft > load.ttft_ms / 1e3 or overloaded):
            share = 0.0
        goodput = served * share if (load.ttft_ms or load.tpot_ms) else served
    else:
        b = cap
        if load.concurrency is not None:
            b = min(b, load.concurrency / ranks)
        else:
            b = _largest_within(lambda x: steady(sustainable(x)), cap, load)
        b = sustainable(max(b, 1.0))
        sec, ttft, parts = steady(b)
        p99 = sec
        if load.concurrency is not None and load.concurrency / ranks > b:
            queued = load.concurrency / ranks - b  # waiting for a seat: whole lifetimes of those ahead
            ttft += queued / b * (osl * sec + ttft)
        served = ranks * b / (osl * sec + ttft)
        meets = ((load.tpot_ms is None or sec <= load.tpot_ms / 1e3)
                 and (load.ttft_ms is None or ttft <= load.ttft_ms / 1e3))
        goodput = served if meets else 0.0
    # Output tokens/s: the completion rate's tokens under a rate, the batch's per step otherwise.
    out_gpu = served * osl / gpus if load.rate is not None else ranks * b / sec / gpus
    return Rates(batch=b, ttft_s=ttft, tpot_p50_s=sec, tpot_p99_s=p99, output_tps_gpu=out_gpu,
                 input_tps_gpu=out_gpu * isl / osl, goodput=goodput, overloaded=overloaded, breakdown=parts)


def _largest_within(steady, cap: float, load: ServeLoad) -> float:
    """The largest running batch in [1, cap] whose step (TPOT) and TTFT meet the targets;
    both grow with the batch, so bisection finds it. 1 when even that misses."""
    def ok(b: float) -> bool:
        sec, ttft, _ = steady(b)
        return ((load.tpot_ms is None or sec <= load.tpot_ms / 1e3)
                and (load.ttft_ms is None or ttft <= load.ttft_ms / 1e3))
    if load.tpot_ms is None and load.ttft_ms is None or ok(cap):
        return cap
    lo, hi = 1, int(cap)
    if not ok(lo):
        return 1.0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return float(lo)


def phase_only(s: Setting, load: ServeLoad, *, ranks: int, gpus: int) -> Rates:
    """`--phase prefill`: every step a full budget of prompt tokens (input tokens/s), TTFT the
    prompt alone; `--phase decode`: steps of decodes only at contexts isl to isl + osl (output
    tokens/s, TPOT), as disaggregated measurements rate one side."""
    if load.phase == "prefill":
        tokens = max(s.max_batch_tokens, load.isl)
        sec, parts = s.step(0, tokens, load)
        ttft = s.step(0, load.isl, load)[0] + s.costs.request_s
        inp = ranks * tokens / sec / gpus
        return Rates(batch=0, ttft_s=ttft, tpot_p50_s=0.0, tpot_p99_s=0.0, output_tps_gpu=0.0, input_tps_gpu=inp,
                     goodput=ranks * tokens / load.isl / sec, breakdown=parts)
    cap = float(s.max_batch)
    if load.concurrency is not None:
        cap = max(1.0, min(cap, load.concurrency / ranks))
    b = _largest_within(lambda x: (*s.step(x, 0, load)[:1], 0.0, None), cap, dataclasses.replace(load, ttft_ms=None))
    sec, parts = s.step(b, 0, load)
    out = ranks * b / sec / gpus
    meets = load.tpot_ms is None or sec <= load.tpot_ms / 1e3
    return Rates(batch=b, ttft_s=0.0, tpot_p50_s=sec, tpot_p99_s=sec, output_tps_gpu=out, input_tps_gpu=0.0,
                 goodput=ranks * b / (load.osl * sec) if meets else 0.0, breakdown=parts)
