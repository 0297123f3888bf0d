"""`phalanx serve --pool auto --nproc N --ttft-ms X --tpot-ms Y`: the serving planner's split of
N ranks into a latency pool and a throughput pool, and each pool's layout (torch-free, plain
functions; `pool_main.py` turns the choice into the pools' specs).

The rule, from the planner's own predictions (`serve_search.evaluate` on the `local` cluster,
with the model's real shape, the server's seats and prompt budget, and serve-local.json's
engine costs where `phalanx calibrate --serve` wrote them):

- the latency pool is the smallest one that meets both targets: for r = 1, 2, ... ranks, every
  layout `phalanx serve` runs over r ranks (instances x tp=k, k dividing r, k a split the model
  allows) is rated at the largest running batch within the targets, and the first r where
  one predicts TTFT and TPOT p50 within them wins; among the layouts of that r the planner's
  ranking (goodput within the targets, then tokens/s, then the faster TPOT) picks one;
- the throughput pool takes every rank left, in the layout the planner rates best without
  targets (requests/s, then output tokens/s per rank, at the batch the seats and KV cache
  allow): its class has no target, so the ranks not needed for the targets serve volume.

Why the smallest latency pool: the throughput pool's rate only grows with its ranks, and a
rank moved to the latency pool beyond what meets the targets serves fewer requests there (its
batch is held to the targets). At run time ranks still move between the pools when one idles
and the other queues past its target (`pool_router.py`), so the start only needs to be right
for the targets, not for a load nobody stated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from phalanx.errors import UserError
from phalanx.model.config import ModelConfig
from phalanx.planner.hardware import Cluster
from phalanx.planner.serve.rates import ServeLoad
from phalanx.planner.serve.search import ServePlan, evaluate
from phalanx.planner.serve.step import ServeLayout
from phalanx.serve.pool_router import PoolSpec, tp_plan

DEFAULT_ISL, DEFAULT_OSL = 512, 128
"""Lengths planned for when --isl/--osl are not given: a prompt of one default step budget
(--max-num-batched-tokens 512), a quarter of it out."""


@dataclass(frozen=True)
class PoolChoice:
    name: str
    tp: int
    instances: int
    plan: ServePlan
    """The planner's rating of the whole pool (all its instances)."""

    @property
    def ranks(self) -> int:
        return self.tp * self.instances

    def spec(self) -> PoolSpec:
        return PoolSpec(self.name, tp_plan(self.tp), self.tp, self.instances)

    def layout(self) -> str:
        return f"{self.instances} x {tp_plan(self.tp)}" if self.instances > 1 else tp_plan(self.tp)


@dataclass(frozen=True)
class AutoSplit:
    latency: PoolChoice
    throughput: PoolChoice
    load: ServeLoad

    def lines(self) -> list[str]:
        """One line per pool, with why."""
        lat, thr, load = self.latency.plan.rates, self.throughput.plan.rates, self.load
        targets = [f"TTFT {lat.ttft_s * 1e3:.0f} ms (target {load.ttft_ms:g})" if load.ttft_ms else
                   f"TTFT {lat.ttft_s * 1e3:.0f} ms",
                   f"TPOT {lat.tpot_p50_s * 1e3:.1f} ms (target {load.tpot_ms:g})" if load.tpot_ms else
                   f"TPOT {lat.tpot_p50_s * 1e3:.1f} ms"]
        smaller = (f"; no layout of {self.latency.ranks - 1} rank{'s' * (self.latency.ranks > 2)} meets them"
                   if self.latency.ranks > 1 else "")
        return [
            f"pool auto: latency {self.latency.layout()} on {_ranks(self.latency.ranks)}: predicted "
            f"{', '.join(targets)} at up to {_sequences(lat.batch)} per instance{smaller}",
            f"pool auto: throughput {self.throughput.layout()} on {_ranks(self.throughput.ranks)}: predicted "
            f"{thr.output_tps_gpu:.1f} output tokens/s per rank at {_sequences(thr.batch)} per instance "
            f"(TPOT {thr.tpot_p50_s * 1e3:.1f} ms, no target)",
        ]


def _ranks(n: int) -> str:
    return f"{n} rank{'s' * (n > 1)}"


def _sequences(batch: float) -> str:
    return f"{batch:.0f} sequence{'s' * (round(batch) != 1)}"


def planned_lengths(model: ModelConfig, isl: int | None, osl: int | None) -> tuple[int, int]:
    """(isl, osl) to plan for: as stated, else the defaults, shortened to the model's positions
    (4/5 prompt) when it has fewer; stated lengths beyond them are refused."""
    for name, value in (("--isl", isl), ("--osl", osl)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be at least 1 token, got {value}")
    if isl is not None or osl is not None:
        isl, osl = isl or DEFAULT_ISL, osl or DEFAULT_OSL
        if isl + osl > model.max_seq_len:
            raise UserError(f"--isl {isl} + --osl {osl} = {isl + osl} tokens is beyond the model's "
                            f"{model.max_seq_len} positions")
        return isl, osl
    if DEFAULT_ISL + DEFAULT_OSL <= model.max_seq_len:
        return DEFAULT_ISL, DEFAULT_OSL
    isl = max(1, model.max_seq_len * 4 // 5)
    return isl, max(1, model.max_seq_len - isl)


def pool_layouts(ranks: int, layout_ok: Callable[[str], bool]) -> list[tuple[int, int]]:
    """(tp, instances) of exactly `ranks` ranks that `phalanx serve` runs for this model."""
    return [(tp, ranks // tp) for tp in range(1, ranks + 1) if ranks % tp == 0 and layout_ok(tp_plan(tp))]


def rate_pool(model: ModelConfig, cluster: Cluster, tp: int, instances: int, load: ServeLoad, *, world: int,
              max_num_seqs: int, max_batch_tokens: int, weight_dtype: str, kv_dtype: str, costs=None):
    """The planner's rating of `instances` x tp=`tp` (None: the KV cache holds no sequence).
    The running batch is at most the server's seats; fewer where the KV cache holds fewer."""
    layout = ServeLayout(tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    common = dict(max_batch_tokens=max_batch_tokens, world=world, costs=costs)
    plan = evaluate(model, cluster, layout, instances, load, max_batch=max_num_seqs, **common)
    return plan or evaluate(model, cluster, layout, instances, load, **common)


def meets(plan: ServePlan, load: ServeLoad) -> bool:
    r = plan.rates
    return ((load.ttft_ms is None or r.ttft_s * 1e3 <= load.ttft_ms)
            and (load.tpot_ms is None or r.tpot_p50_s * 1e3 <= load.tpot_ms))


def check_auto(*, ttft_ms: float | None, tpot_ms: float | None, ranks: int) -> None:
    """What `--pool auto` needs before the model is read: a target, and ranks for two pools."""
    if ttft_ms is None and tpot_ms is None:
        raise UserError("--pool auto sizes a latency pool for --ttft-ms/--tpot-ms: give at least one, or name "
                        "the pools (--pool latency:tp=2 --pool throughput:tp=1)")
    if ranks < 2:
        raise UserError(f"--pool auto splits --nproc ranks into a latency and a throughput pool: --nproc must be "
                        f"at least 2, got {ranks}")


def auto_split(model: ModelConfig, cluster: Cluster, *, ranks: int, load: ServeLoad, max_num_seqs: int,
               max_batch_tokens: int, weight_dtype: str, kv_dtype: str, layout_ok: Callable[[str], bool],
               costs=None) -> AutoSplit:
    """The latency and throughput pools of `ranks` ranks for `load`'s targets (module docstring).
    `layout_ok(plan)`: whether the model runs in that layout (tp divides its heads, ...)."""
    check_auto(ttft_ms=load.ttft_ms, tpot_ms=load.tpot_ms, ranks=ranks)
    rate = dict(world=ranks, max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens,
                weight_dtype=weight_dtype, kv_dtype=kv_dtype, costs=costs)
    free = ServeLoad(isl=load.isl, osl=load.osl)  # the throughput class: no target
    fastest: PoolChoice | None = None
    for size in range(1, ranks):
        rated = [PoolChoice("latency", tp, n, plan) for tp, n in pool_layouts(size, layout_ok)
                 if (plan := rate_pool(model, cluster, tp, n, load, **rate)) is not None]
        for choice in rated:
            if fastest is None or choice.plan.rates.tpot_p50_s < fastest.plan.rates.tpot_p50_s:
                fastest = choice
        within = [c for c in rated if meets(c.plan, load)]
        if not within:
            continue
        latency = max(within, key=lambda c: c.plan.key)
        rest = [PoolChoice("throughput", tp, n, plan) for tp, n in pool_layouts(ranks - size, layout_ok)
                if (plan := rate_pool(model, cluster, tp, n, free, **rate)) is not None]
        if rest:
            return AutoSplit(latency, max(rest, key=lambda c: c.plan.key), load)
    if fastest is None:
        raise UserError(f"--pool auto: no layout of up to {ranks - 1} ranks holds one sequence of --isl {load.isl} + "
                        f"--osl {load.osl} tokens in its KV cache; try shorter --isl/--osl")
    r = fastest.plan.rates
    sizes = "1 rank" if ranks == 2 else f"1 to {ranks - 1} of the {ranks} ranks"
    raise UserError(f"--pool auto: no latency pool of {sizes} meets "
                    + " and ".join(f"--{k}-ms {v:g}" for k, v in (("ttft", load.ttft_ms), ("tpot", load.tpot_ms)) if v)
                    + f" (the fastest, {fastest.layout()}, is predicted at TTFT {r.ttft_s * 1e3:.0f} ms, TPOT "
                    f"{r.tpot_p50_s * 1e3:.1f} ms for one sequence at isl {load.isl}); loosen the targets, give "
                    "more --nproc, or name the pools")
