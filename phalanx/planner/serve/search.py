"""The serving planner's search: every way to lay out N GPUs as instances of dp x tp x pp
ranks (ep carved from dp), each with the running batch and prompt budget its KV cache allows,
rated by serve/rates.py and ranked by goodput under the targets (without targets or a load:
by output tokens/s per GPU at the concurrency the KV cache allows).

The rules (one place): tp divides the attention heads and stays inside a fast domain (its
all-reduces are on every layer's path); ep divides the dp ranks and the routed-expert slots
(S per MoE layer, at least the experts: one slot per expert unless redundant experts are
wanted or ep does not divide the experts, `serve/expert_load.slot_choices`); pp is at most
the layer count; world = instances x dp x tp x pp.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from phalanx import layout_rules as rules
from phalanx.errors import UserError
from phalanx.layout_rules import divisors
from phalanx.plan import key_values
from phalanx.model.config import ModelConfig
from phalanx.planner.hardware import Cluster
from phalanx.planner.serve.costs import ServeCosts, serve_costs_for
from phalanx.planner.serve.expert_load import ExpertLoad, expected_imbalance, slot_choices
from phalanx.planner.serve.memory import VLLM_POOL, PoolRule, RankMemory, max_batch_for, rank_memory
from phalanx.planner.serve.rates import Rates, ServeLoad, Setting, colocated, phase_only
from phalanx.planner.serve.step import ServeLayout

FIX_KEYS = ("tp", "ep", "dp", "pp", "slots", "max_batch", "max_batch_tokens", "instances")
TRAINING_ONLY_KEYS = ("zero", "fsdp", "schedule", "virtual", "mbs", "microbatches", "recompute", "sp",
                      "replicate", "offload", "split", "cp", "ep_over_tp")
BUDGETS = (512, 2048, 8192)
"""Prompt-token budgets per step searched (phalanx serve's default 512; SGLang's chunked
prefill and TensorRT-LLM's max_num_tokens default to 8192)."""


def parse_serve_fix(text: str) -> dict[str, int]:
    """`tp=2,max_batch=64`: serving knobs; training-only keys and unknown ones are errors."""
    fixed: dict[str, int] = {}
    for key, raw in key_values(text, what="--fix"):  # the training --fix's reader too (phalanx/plan.py)
        if key in TRAINING_ONLY_KEYS:
            raise UserError(f"--fix {key}= is a training knob; a serving --fix takes {', '.join(FIX_KEYS)}")
        if key not in FIX_KEYS:
            raise UserError(f"--fix: unknown serving key {key!r}; valid keys: {', '.join(FIX_KEYS)}")
        try:
            value = int(raw)
        except ValueError:
            raise UserError(f"--fix {key}={raw!r} must be a whole number") from None
        if value < 1:
            raise UserError(f"--fix {key}={value} must be at least 1")
        fixed[key] = value
    return fixed


@dataclass(frozen=True, kw_only=True)
class ServePlan:
    layout: ServeLayout
    instances: int
    max_batch: int
    max_batch_tokens: int
    rates: Rates
    memory: RankMemory
    prefill_gpus: int
    decode_gpus: int
    prefill_layout: ServeLayout | None = None
    """Disaggregated: the prefill side's layout (`layout` is then the decode side's)."""
    prefill_instances: int = 0
    notes: tuple[str, ...] = ()
    """What phalanx serve does not run of this plan (other engines do)."""
    expert_load: ExpertLoad | None = None
    """The expert load skew the plan's slots were placed and priced for (`--expert-load`)."""
    imbalance_one_slot_each: float | None = None
    """What the same ep would leave with one slot per expert, placed by the balancer for the
    same loads (the imbalance the replicas remove); None where ep does not divide the experts
    (then there is no such layout) or the model has none."""

    @property
    def key(self) -> tuple[float, float, float]:
        return (self.rates.goodput, self.rates.output_tps_gpu + self.rates.input_tps_gpu, -self.rates.tpot_p50_s)


@dataclass
class ServeSearchResult:
    ranked: list[ServePlan] = field(default_factory=list)
    considered: int = 0
    pruned_memory: int = 0
    seconds: float = 0.0


def check_fixed_slots(model: ModelConfig, fixed: dict[str, int]) -> None:
    """`--fix slots=S` on a model whose experts S cannot hold: one line (phalanx serve's rule)."""
    if "slots" in fixed:
        problem = rules.expert_slots_count_problem(fixed["slots"], n_experts=model.n_experts, model=model.name,
                                                   flag=f"--fix slots={fixed['slots']}")
        if problem:
            raise UserError(problem.replace(f"--expert-slots={fixed['slots']}", f"--fix slots={fixed['slots']}"))


def _slot_counts(model: ModelConfig, ep: int, fixed: dict[str, int], expert_load: ExpertLoad | None) -> list[int]:
    """Slot counts S at this ep: pinned, or the search's (`slot_choices`); ep divides each, and
    no rank holds two slots of one expert (S / ep <= E, the balancer's rule)."""
    if not model.n_experts:
        return [0]
    choices = [fixed["slots"]] if "slots" in fixed else slot_choices(model.n_experts, ep, expert_load)
    return [s for s in choices if s % ep == 0 and s // ep <= model.n_experts and s >= model.n_experts]


def layouts(model: ModelConfig, cluster: Cluster, gpus: int, fixed: dict[str, int], *, weight_dtype: str,
            kv_dtype: str, expert_load: ExpertLoad | None = None):
    """(layout, instances) of exactly `gpus` devices that obey the rules and `fixed`, each
    layout with its expert slots and the imbalance the balancer leaves them for `expert_load`."""
    for instances in divisors(gpus):
        if fixed.get("instances", instances) != instances:
            continue
        per = gpus // instances
        for tp in divisors(per):
            if fixed.get("tp", tp) != tp or model.n_heads % tp or tp > cluster.fast_domain:
                continue
            for pp in divisors(per // tp):
                if fixed.get("pp", pp) != pp or pp > model.n_layers:
                    continue
                dp = per // (tp * pp)
                if fixed.get("dp", dp) != dp:
                    continue
                eps = divisors(dp) if model.n_experts else [1]
                for ep in eps:
                    # dp ranks without ep share nothing: they are instances (unless pinned).
                    if fixed.get("ep", ep) != ep or (dp > 1 and ep == 1 and "dp" not in fixed):
                        continue
                    for slots in _slot_counts(model, ep, fixed, expert_load):
                        imbalance = expected_imbalance(expert_load, n_experts=model.n_experts, slots=slots, ep=ep)
                        yield ServeLayout(tp=tp, ep=ep, dp=dp, pp=pp, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                          slots=0 if slots == model.n_experts else slots,
                                          expert_imbalance=imbalance), instances


def phalanx_serve_gaps(layout: ServeLayout, *, instances: int, disaggregated: bool = False) -> tuple[str, ...]:
    """What keeps `phalanx serve` from running this plan today (docs/serve.md)."""
    notes = []
    if layout.pp > 1:
        notes.append("pipeline stages")
    if layout.dp > 1 and not (layout.ep == layout.dp and layout.tp == 1):
        notes.append("dp other than dp=N,ep=N")
    if layout.tp > 1 and layout.ep > 1:
        notes.append("experts split over tp with ep")
    if layout.slots and (layout.tp > 1 or layout.pp > 1):
        notes.append("expert slots beside tp or pp")
    if layout.weight_dtype in ("fp8", "fp4"):
        notes.append(f"{layout.weight_dtype} weights")
    if layout.kv_dtype == "fp8":
        notes.append("an fp8 KV cache")
    if disaggregated:
        notes.append("prefill/decode disaggregation")
    return tuple(notes)


def evaluate(model: ModelConfig, cluster: Cluster, layout: ServeLayout, instances: int, load: ServeLoad, *,
             max_batch: int | None = None, max_batch_tokens: int, world: int, costs=None,
             pool: PoolRule = VLLM_POOL) -> ServePlan | None:
    """One layout at one prompt budget; None when the KV cache holds no whole sequence (or
    fewer than a fixed max_batch). `pool`: how the engine sizes its KV cache (vLLM's rule)."""
    costs = costs or serve_costs_for(cluster)
    mem = rank_memory(model, cluster, layout, max_batch_tokens=max_batch_tokens, pool=pool)
    fits = max_batch_for(mem, isl=load.isl, osl=load.osl if load.phase != "prefill" else 0, pp=layout.pp,
                         limit=pool.max_batch)
    batch = min(fits, max_batch) if max_batch else fits
    if batch < 1 or (max_batch and fits < max_batch):
        return None
    setting = Setting(model, cluster, layout, costs, world if cluster.shared_compute else layout.gpus,
                      batch, max_batch_tokens)
    ranks, gpus = instances * layout.dp, instances * layout.gpus
    rates = (phase_only if load.phase != "both" else colocated)(setting, load, ranks=ranks, gpus=gpus)
    return ServePlan(layout=layout, instances=instances, max_batch=batch, max_batch_tokens=max_batch_tokens,
                     rates=rates, memory=mem, prefill_gpus=gpus if load.phase != "decode" else 0,
                     decode_gpus=gpus if load.phase != "prefill" else 0,
                     notes=phalanx_serve_gaps(layout, instances=instances), expert_load=load.expert_load,
                     imbalance_one_slot_each=_one_slot_each(model, layout, load))


def _one_slot_each(model: ModelConfig, layout: ServeLayout, load: ServeLoad) -> float | None:
    if not model.n_experts or model.n_experts % layout.ep:
        return None
    return expected_imbalance(load.expert_load, n_experts=model.n_experts, slots=model.n_experts, ep=layout.ep)


def search_serving(model: ModelConfig, cluster: Cluster, load: ServeLoad, *, gpus: int, fixed: dict[str, int],
                   weight_dtype: str = "bf16", kv_dtype: str = "bf16", keep: int = 10,
                   pool: PoolRule = VLLM_POOL, costs: ServeCosts | None = None) -> ServeSearchResult:
    """`costs`: the engine's framework costs (default: what `serve_costs_for` gives the cluster)."""
    start = time.perf_counter()
    result = ServeSearchResult()
    costs = costs or serve_costs_for(cluster)
    check_fixed_slots(model, fixed)
    budgets = (fixed["max_batch_tokens"],) if "max_batch_tokens" in fixed else BUDGETS
    if load.phase == "decode" and "max_batch_tokens" not in fixed:
        budgets = BUDGETS[:1]  # decode steps carry no prompt tokens: the budget changes only the workspace
    plans = []
    for layout, instances in layouts(model, cluster, gpus, fixed, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                     expert_load=load.expert_load):
        best = None
        for budget in budgets:
            result.considered += 1
            plan = evaluate(model, cluster, layout, instances, load, max_batch=fixed.get("max_batch"),
                            max_batch_tokens=budget, world=gpus, costs=costs, pool=pool)
            if plan is None:
                result.pruned_memory += 1
            elif best is None or plan.key > best.key:
                best = plan
        if best is not None:
            plans.append(best)
    plans.sort(key=lambda p: p.key, reverse=True)
    result.ranked = plans[:keep]
    result.seconds = time.perf_counter() - start
    return result
