"""Enumerate every valid layout, prune those that do not fit, rank the rest by step time.

The space: tp over divisors of the world size up to the fast domain (and dividing the heads),
pp over divisors up to the layer count, cp over divisors that cut each sequence into 2 x cp
chunks of at least `SearchSpace.min_cp_chunk` positions, dp the rest (dividing the global
batch), ep over divisors of dp x cp that divide the expert count, every micro-batch size that divides the
per-rank batch (up to `max_mbs`), each schedule with its virtual stages, each recompute
mode and each ZeRO level allowed. Knobs this cost model proves dominated are not searched
(a `--fix` still evaluates them): sp=false when tp > 1 (same bytes as SP, more memory),
gpipe (1F1B's bubble, more memory) and, with flash attention, selective recompute (flash
already keeps no s x s scores, so it saves nothing and recomputes the attention core).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from phalanx import layout_rules as rules
from phalanx.errors import UserError
from phalanx.layout_rules import divisors
from phalanx.model.config import ModelConfig
from phalanx.plan import RECOMPUTE, Plan, key_values, parse_plan
from phalanx.planner.cost import Estimate, evaluate, step_time_lower_bound
from phalanx.planner.energy import Objective
from phalanx.planner.options import Options, trainer_options
from phalanx.planner.peak_memory import memory_breakdown
from phalanx.planner.hardware import Cluster, cluster_from_name
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.memory_fit import fewest_recomputed_layers
from phalanx.planner.slot_layouts import slots_problem

@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Which knob values the search may use."""

    zero_levels: tuple[int, ...] = (0, 3)
    """What the phalanx trainer runs: replicated (fsdp=false) or fully sharded (fsdp=true)."""
    recompute: tuple[str, ...] = RECOMPUTE
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zbv", "dualpipev")
    """gpipe is left out: same bubble as 1f1b, more memory (`--fix schedule=gpipe` evaluates it)."""
    virtual: tuple[int, ...] = (2, 3, 4, 6, 8)
    """Chunks per rank tried for the interleaved schedule."""
    max_mbs: int = 16
    sequence_parallel: bool = True
    """Use sp with tp > 1; False for implementations that lack it."""
    min_cp_chunk: int = 1024
    """cp is searched only where each of a sequence's 2 x cp chunks keeps at least this many
    positions (Llama 3's 131,072-token stage: 4,096 with cp 16). A bound on the search's size,
    which each cp value multiplies, not a claim of the cost model: what cp buys is activation
    memory per sequence, which short sequences do not need. `--fix cp=N` evaluates any cp."""
    cp_rings: tuple[bool, ...] = (False, True)
    """With cp > 1, the trainer's cp schedules tried (the plan's cp_ring): the all-gather and
    the ring, each priced (stage_time.cp_exposed) so the faster is picked per layout; (True,)
    under `--cp-overlap`. Latent attention, and other implementations, keep the gather, and so
    does a CPU cluster unless asked (`--fix cp_ring=true`, `--cp-overlap`)."""
    phalanx_trainer: bool = True
    """Only layouts phalanx's trainer accepts: tp divides n_kv_heads and the vocabulary (no
    padding), sp needs tp to divide seq_len and no experts; tp leaves the MoE blocks whole (pair
    with Options.tp_splits_experts=False). Off to model other implementations (the published
    runs), which split experts over tp."""


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    ranked: list[Estimate]
    """Layouts that fit in memory, best first by the search's objective (fastest first by
    default; with a `max_slowdown`, only those within it of the fastest), at most `keep`."""
    considered: int
    pruned_memory: int
    fastest_pruned: Estimate | None
    """The fastest layout that did not fit, if it was faster than the fastest that fits."""
    fastest: Estimate | None = None
    """The fastest layout that fits (ranked[0] when ranking by time), for explaining another objective's choice."""
    seconds: float
    offload_only: bool = False
    """Nothing fitted on the device, so the ranked layouts keep their weights, gradients and
    optimizer state on the host (offload=true, zero 3): slower, picked only then."""


def parse_fix(text: str) -> dict[str, object]:
    """`--fix` string -> the Layout fields it pins (plan grammar plus mbs and zero)."""
    plan, extras = parse_plan(text, extra_keys=("mbs", "zero"))
    given = {key for key, _ in key_values(text)}
    fixed: dict[str, object] = {}
    for key in given - {"mbs", "zero", "fsdp", *extras}:
        fixed[key] = getattr(plan, key)
    for key, raw in extras.items():
        try:
            fixed[key] = int(raw)
        except ValueError:
            raise UserError(f"plan key {key}={raw!r} must be an integer") from None
    for key in ("dp", "cp", "tp", "pp", "ep"):  # a degree of 0 would divide by zero below
        if int(fixed.get(key, 1)) < 1:
            raise UserError(f"plan key {key}={fixed[key]} must be at least 1")
    if "fsdp" in given:
        if "zero" in fixed and (fixed["zero"] == 3) != plan.fsdp:
            raise UserError(f"fsdp={str(plan.fsdp).lower()} contradicts zero={fixed['zero']}")
        if plan.fsdp:
            fixed["zero"] = 3
        elif "zero" not in fixed:
            fixed["zero_not3"] = True
    return fixed


def _schedules(space: SearchSpace, pp: int, m: int, n_layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for name in space.schedules:
        virtuals = space.virtual if name == "interleaved" else (2,) if name in rules.V_SCHEDULES else (1,)
        out += [(name, v) for v in virtuals
                if not rules.pipeline_problem(name, pp=pp, virtual=v, microbatches=m, n_layers=n_layers)]
    return out


def _tp_problem(model: ModelConfig, tp: int, space: SearchSpace) -> str:
    """Why tp cannot split this model in the implementations the search covers. The phalanx
    trainer keeps MoE blocks out of tp (whole experts on every tp rank: the cost model charges
    that work and memory, Options.tp_splits_experts), so no expert size need divide by tp there."""
    return rules.tp_problem(tp, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, ffn_dim=model.ffn_dim,
                            vocab_size=model.vocab_size, expert_ffn_dim=model.moe_ffn_dim,
                            n_experts=0 if space.phalanx_trainer else model.n_experts,
                            padded=not space.phalanx_trainer)


def _plans(space: SearchSpace, fixed: dict[str, object], *, dp: int, tp: int, pp: int, ep: int, microbatches: int,
           fold: bool, sp_ok: bool, n_layers: int, cp: int = 1, ring: bool = False):
    """(plan, zero level) for each schedule, recompute mode and zero level the space allows
    for one split of the devices and of the batch (zero level 1 is a planning knob: ZeRO-1)."""
    f = fixed.get
    for schedule, v in _schedules(space, pp, microbatches, n_layers):
        if f("schedule", schedule) != schedule or f("virtual", v) != v:
            continue
        for rc in space.recompute if "recompute" not in fixed else (fixed["recompute"],):
            zeros = (fixed["zero"],) if "zero" in fixed else space.zero_levels
            for zero in zeros:
                if fixed.get("zero_not3") and zero == 3:
                    continue
                offload = bool(f("offload", False))
                if space.phalanx_trainer and pp > 1 and zero == 3 and 2 in zeros and not offload:
                    continue  # the trainer keeps weights gathered under pp: zero 3 runs as zero 2
                if offload and (zero != 3 or dp * cp == 1):
                    continue  # FSDP2 offloads the shards of zero 3 over dp > 1
                sp = fixed.get("sp", tp > 1 and sp_ok)
                yield Plan(cp=cp, dp=dp, tp=tp, pp=pp, ep=ep, microbatches=microbatches, schedule=schedule, virtual=v,
                           recompute=rc, zero=0 if zero == 1 else zero, sp=bool(sp), replicate=int(f("replicate", 1)),
                           offload=offload, ep_over_tp=fold, cp_ring=ring), zero


def candidates(model: ModelConfig, cluster: Cluster, workload: Workload, *, world_size: int,
               fixed: dict[str, object], space: SearchSpace):
    """Every layout the space allows, honouring the fixed fields."""
    f = fixed.get
    max_tp = max(cluster.fast_domain, min(cluster.devices_per_node, 8))
    gb = workload.global_batch
    for tp in divisors(world_size):
        if f("tp", tp) != tp or (tp > max_tp and "tp" not in fixed):
            continue
        if _tp_problem(model, tp, space):
            continue
        sp_problem = rules.sp_problem(tp, seq_len=workload.seq_len)
        # The trainer runs no sp with experts (plan_model_checks.validate_tp).
        sp_ok = space.sequence_parallel and not (space.phalanx_trainer and (sp_problem or model.n_experts))
        for pp, cp in ((pp, cp) for pp in divisors(world_size // tp) for cp in divisors(world_size // (tp * pp))):
            dp = world_size // (tp * pp * cp)
            if f("pp", pp) != pp or f("dp", dp) != dp or pp > model.n_layers or gb % dp or f("cp", cp) != cp:
                continue
            if rules.cp_problem(cp, seq_len=workload.seq_len) or (
                    "cp" not in fixed and cp > 1 and workload.seq_len < 2 * cp * space.min_cp_chunk):
                continue
            cp_sp_ok = sp_ok and not rules.cp_problem(cp, seq_len=workload.seq_len, tp=tp, sp=True)
            if fixed.get("sp") and not cp_sp_ok and rules.cp_problem(cp, seq_len=workload.seq_len, tp=tp, sp=True):
                continue
            # The trainer's ep_over_tp=true (MoE parallel folding): ep over dp x tp, tp ranks
            # splitting the expert rows instead of repeating them; tried beside the duplicated one
            # (without cp, whose ranks hold other tokens: ep is then carved from dp x cp).
            folds = (False, True) if space.phalanx_trainer and tp > 1 and model.n_experts and cp == 1 else (False,)
            # The trainer's cp schedules (gather or ring), each priced: the planner picks per layout.
            rings = space.cp_rings if space.phalanx_trainer and cp > 1 and not model.is_latent else (False,)
            if cluster.shared_compute and len(rings) > 1 and "cp_ring" not in fixed:
                # On CPUs gloo's transfers run on the cores that compute, so no ring step hides
                # behind attention: the two price alike, and the ring's smaller kernel calls and
                # per-step merges took 1-6% more CPU than the gather in 5 of 6 comparisons
                # (benchmarks/context_parallel.py's attention rows, benchmarks/README.md).
                rings = (False,)
            rings = tuple(ring for ring in rings if bool(f("cp_ring", ring)) == ring)
            for fold in folds:
                if bool(f("ep_over_tp", fold)) != fold:
                    continue
                ranks = dp * tp if fold else dp * cp
                eps = ([e for e in divisors(ranks) if model.n_experts % e == 0 and (e > 1 or not fold)]
                       if model.n_experts else [1])
                for ep in eps:
                    if f("ep", ep) != ep:
                        continue
                    per_rank = gb // dp
                    for mbs in divisors(per_rank):
                        m = per_rank // mbs
                        if "mbs" in fixed:
                            if mbs != fixed["mbs"]:
                                continue
                        elif mbs > space.max_mbs:
                            break
                        if f("microbatches", m) != m:
                            continue
                        for ring in rings:
                            for plan, zero in _plans(space, fixed, dp=dp, tp=tp, pp=pp, ep=ep, microbatches=m,
                                                     fold=fold, sp_ok=cp_sp_ok, n_layers=model.n_layers, cp=cp,
                                                     ring=ring):
                                yield Layout(plan, mbs=mbs, zero1=zero == 1, cp=cp)


def search(model: ModelConfig, cluster: Cluster, workload: Workload, *, world_size: int,
           fixed: dict[str, object] | None = None, space: SearchSpace = SearchSpace(),
           options: Options = Options(), keep: int = 10, objective: Objective = Objective()) -> SearchResult:
    """Rank every fitting layout by the objective (predicted step time by default, or energy or
    cost per step: energy.py); count the ones memory pruned."""
    start = time.perf_counter()
    fixed = dict(fixed or {})
    if "zero" in fixed and fixed["zero"] not in space.zero_levels:
        space = dataclasses.replace(space, zero_levels=(int(fixed["zero"]),))
    if "schedule" in fixed and fixed["schedule"] not in space.schedules:
        space = dataclasses.replace(space, schedules=(str(fixed["schedule"]),))
    if "virtual" in fixed and fixed["virtual"] not in space.virtual:
        space = dataclasses.replace(space, virtual=(int(fixed["virtual"]),))
    if options.cp_overlap and space.phalanx_trainer:  # --cp-overlap: the trainer's ring wherever cp > 1
        space = dataclasses.replace(space, cp_rings=(True,))
    if options.flash_attention and "recompute" not in fixed and "selective" in space.recompute:
        space = dataclasses.replace(space, recompute=tuple(r for r in space.recompute if r != "selective"))
    if options.expert_slots and (problem := rules.expert_slots_count_problem(
            options.expert_slots, n_experts=model.n_experts, model=model.name)):
        raise UserError(problem)
    fitting: list[Estimate] = []
    considered = 0
    too_big: list[Layout] = []
    usable = cluster.usable_bytes
    for layout in candidates(model, cluster, workload, world_size=world_size, fixed=fixed, space=space):
        if slots_problem(model, layout, options):
            continue  # a layout the trainer refuses with these slots
        considered += 1
        # Memory first: it is a fraction of the time model's cost, and most layouts of a big
        # model fail it (6,104 of 6,809 for the 1T GPT on 3,072 GPUs).
        if sum(memory_breakdown(model, workload, layout, options).values()) > usable:
            too_big.append(layout)
            continue
        est = evaluate(model, cluster, workload, layout, options)
        fitting.append(est)
        if "recompute_layers" not in fixed and "recompute" not in fixed:  # a fixed mode means all blocks
            partial = fewest_recomputed_layers(model, cluster, workload, est, options)
            if partial is not None:
                considered += 1
                fitting.append(partial)
    offload_only = False
    if not fitting and "offload" not in fixed and fixed.get("zero", 3) == 3:
        # Last resort: offload moves the shards off the device. The time model does not charge
        # the host transfers yet, so it is never weighed against a layout that fits without it.
        for layout in candidates(model, cluster, workload, world_size=world_size, fixed={**fixed, "offload": True},
                                 space=dataclasses.replace(space, zero_levels=(3,))):
            if slots_problem(model, layout, options):
                continue
            considered += 1
            if sum(memory_breakdown(model, workload, layout, options).values()) <= usable:
                fitting.append(evaluate(model, cluster, workload, layout, options))
        offload_only = bool(fitting)
    fitting.sort(key=lambda e: (e.step_time_s, e.memory_bytes))
    best = fitting[0].step_time_s if fitting else math.inf
    ranked = fitting if objective.kind == "time" and objective.max_slowdown is None else objective.rank(fitting)
    return SearchResult(ranked=ranked[:keep], fastest=fitting[0] if fitting else None, considered=considered, pruned_memory=len(too_big),
                        fastest_pruned=_fastest(model, cluster, workload, too_big, options, best),
                        seconds=time.perf_counter() - start, offload_only=offload_only)


def _fastest(model: ModelConfig, cluster: Cluster, workload: Workload, layouts: list[Layout],
             options: Options, below: float) -> Estimate | None:
    """The fastest of `layouts` if it beats `below`, else None: priced in the order of their
    lower bounds, stopping at the first bound no faster than the best found (branch and bound)."""
    bounds: dict[tuple, float] = {}  # the bound does not depend on the ZeRO level: one per rest
    bounded = []
    for i, lay in enumerate(layouts):
        key = (lay.tp, lay.cp, lay.cp_ring, lay.pp, lay.ep, lay.ep_over_tp, lay.mbs, lay.microbatches, lay.sp, lay.schedule,
               lay.virtual,
               lay.recompute, lay.recompute_layers)
        if key not in bounds:
            bounds[key] = step_time_lower_bound(model, cluster, workload, lay, options)
        bounded.append((bounds[key], i))
    bounded.sort()
    found: Estimate | None = None
    for bound, i in bounded:
        if bound >= min(below, found.step_time_s if found else math.inf):
            break
        est = evaluate(model, cluster, workload, layouts[i], options)
        if est.step_time_s < below and (found is None or est.step_time_s < found.step_time_s):
            found = est
    return found


def auto_plan(model: ModelConfig, *, world_size: int, global_batch: int, seq_len: int,
              cluster: Cluster | str = "local", fixed: dict[str, object] | None = None,
              space: SearchSpace = SearchSpace(), dtype: str = "fp32", expert_slots: int = 0) -> Plan:
    """The fastest layout `phalanx train --plan auto` can run on `world_size` processes.

    `fixed` pins knobs (as `parse_fix` returns them) for a trainer that lacks some, e.g.
    {"tp": 1, "pp": 1} for a data-parallel-only build; `space` narrows the rest. `dtype`: the
    run's --dtype (the trainer's default fp32); memory and traffic are the trainer's own
    (`options.trainer_options`), not the published implementations'. `expert_slots`: the run's
    --expert-slots (n_experts for --rebalance-every alone, 0 for neither): only layouts the
    trainer runs slots in, with S / ep slots of expert state per rank.
    """
    if isinstance(cluster, str):
        cluster = cluster_from_name(cluster)
    workload = Workload(global_batch=global_batch, seq_len=seq_len)
    options = trainer_options(dtype, cluster, expert_slots=expert_slots)
    result = search(model, cluster, workload, world_size=world_size, fixed=fixed, space=space,
                    options=options, keep=1)
    if not result.ranked:
        if result.considered == 0 and expert_slots:
            reasons = fix_problems(model, workload, world_size, fixed or {}, space, expert_slots=expert_slots)
            raise UserError(f"no layout of {model.name!r} on {world_size} processes runs --expert-slots={expert_slots}"
                            + (f": {'; '.join(reasons)}" if reasons else ""))
        if result.considered == 0:
            raise UserError(f"no layout of {model.name!r} on {world_size} processes divides "
                            f"global batch {global_batch} (dp must divide it)")
        raise UserError(f"no layout of {model.name!r} on {world_size} processes fits in "
                        f"{cluster.memory_gib - cluster.memory_reserved_gib:.1f} GiB per device "
                        f"({result.pruned_memory} pruned by memory)")
    return result.ranked[0].layout.plan


def fix_problems(model: ModelConfig, workload: Workload, world_size: int, fixed: dict[str, object],
                 space: SearchSpace, expert_slots: int = 0) -> list[str]:
    """Why no layout of `world_size` devices matches a `--fix` (the pinned knobs' own rules) or
    runs `--expert-slots` (no ep the layouts allow divides S)."""
    f = fixed.get
    tp, pp, cp = int(f("tp", 1)), int(f("pp", 1)), int(f("cp", 1))
    out = []
    if world_size % (tp * pp * cp):
        out.append(f"cp={cp} x tp={tp} x pp={pp} = {cp * tp * pp} does not divide {world_size} GPUs")
    dp = int(f("dp", world_size // (tp * pp * cp) if world_size % (tp * pp * cp) == 0 else 0))
    if "dp" in fixed and dp * cp * tp * pp != world_size:
        out.append(f"dp={dp} x cp={cp} x tp={tp} x pp={pp} = {dp * cp * tp * pp}, not {world_size} GPUs")
    if problem := rules.cp_problem(cp, seq_len=workload.seq_len, tp=tp, sp=bool(f("sp", False))):
        out.append(problem)
    if f("cp_ring") and "cp" in fixed and cp == 1:
        out.append("cp_ring=true needs cp > 1 (it passes keys and values around the cp ranks)")
    if f("cp_ring") and (problem := rules.cp_ring_problem(True, latent=model.is_latent, model=model.name)):
        out.append(problem)
    if dp and workload.global_batch % dp:
        out.append(f"dp={dp} does not divide global batch {workload.global_batch}")
    if dp and "mbs" in fixed and (workload.global_batch // dp) % int(fixed["mbs"]):
        out.append(f"mbs={fixed['mbs']} does not divide the {workload.global_batch // dp} sequences per dp rank")
    if problem := _tp_problem(model, tp, space):
        out.append(problem + ("" if space.phalanx_trainer is False else " (in the phalanx trainer; --any-runtime "
                                                                         "models implementations that pad)"))
    if "ep" in fixed and dp and (problem := rules.ep_problem(int(fixed["ep"]), dp=dp, n_experts=model.n_experts, tp=tp,
                                                             over_tp=bool(f("ep_over_tp", False)))):
        out.append(problem)
    if expert_slots:
        ep = int(fixed["ep"]) if "ep" in fixed else None
        if problem := rules.expert_slots_layout_problem(expert_slots, ep=ep, over_tp=bool(f("ep_over_tp", False)),
                                                        tp=tp, pp=pp,
                                                        fsdp=rules.runs_fsdp(dp, zero=int(f("zero", 0)), tp=tp, pp=pp),
                                                        edp=dp // ep if dp and ep else None,
                                                        expert_shape=(model.moe_ffn_dim, model.dim),
                                                        offload=bool(f("offload", False))):
            out.append(problem)
        elif ep is None and dp and not any(expert_slots % e == 0 for e in divisors(dp)[1:] if model.n_experts % e == 0):
            out.append(f"--expert-slots={expert_slots} is not a multiple of any ep > 1 that divides dp={dp} and "
                       f"n_experts={model.n_experts}")
    if pp > model.n_layers:
        out.append(f"pp={pp} exceeds n_layers={model.n_layers}")
    elif pp > 1 and dp and "schedule" in fixed:
        m = int(f("microbatches", 0)) or workload.global_batch // dp // int(f("mbs", 1))
        virtual = int(f("virtual", 2 if fixed["schedule"] in rules.V_SCHEDULES else 1))
        if problem := rules.pipeline_problem(str(fixed["schedule"]), pp=pp, virtual=virtual, microbatches=m,
                                             n_layers=model.n_layers):
            out.append(problem)
    return out
