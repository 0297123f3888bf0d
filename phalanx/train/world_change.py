"""Which plan a run runs with on its number of processes; torch-free, read by `train/job.py`.

- `--plan auto`: the planner's choice for this world size (`auto_plan_for`).
- No plan: data parallelism over every process.
- A user's plan, when the run continues on another number of processes (a node lost, a rerun
  with another --nproc, an elastic launch with --nnodes MIN:MAX): tp, pp, ep and every other
  key are kept and dp follows the world size; the number of micro-batches follows too, so each
  micro-batch keeps its size (what fitted in memory still fits) and the global batch is
  unchanged. When that cannot work (tp x pp does not divide the new world, dp no longer divides
  the global batch, ep no longer divides dp...), a one-line error names a plan that does: the
  planner's.

Only when the world size really changed (the checkpoint's differs, or the launch is elastic):
otherwise a plan that names another world size is the user's mistake, reported as before. The
checkpoint is resharded by DCP on load, and resume_settings.py logs the changed plan.
"""

from __future__ import annotations

from phalanx.errors import UserError
from phalanx.plan import Plan, parse_plan
from phalanx.plan_model_checks import validate_for_model
from phalanx.planner.hardware import this_machine
from phalanx.planner.search import auto_plan


def dp_follows(plan: Plan, world_size: int, global_batch: int) -> Plan:
    """`plan` with dp = world_size / (cp x tp x pp) and micro-batches of the same size;
    UserError when cp x tp x pp does not divide the world size."""
    fixed = plan.cp * plan.tp * plan.pp
    if world_size % fixed:
        cp = f"cp={plan.cp} x " if plan.cp > 1 else ""
        raise UserError(f"{cp}tp={plan.tp} x pp={plan.pp} = {fixed} does not divide {world_size} processes")
    dp = world_size // fixed
    micro_size = max(1, global_batch // plan.dp // plan.num_microbatches)  # sequences per micro-batch before
    per_rank = global_batch // dp
    # Shares were given per dp rank of the old world (a mixed cluster's plan): with other ranks
    # they name nobody, so the run starts equal and adaptation measures the new ranks' speeds.
    adapted = plan.replace(dp=dp, shares=plan.shares if dp == plan.dp else "")
    if per_rank % micro_size == 0 and per_rank // micro_size != adapted.num_microbatches:
        adapted = adapted.replace(microbatches=per_rank // micro_size)
    return adapted


def planned_expert_slots(cfg, model_cfg) -> int:
    """The expert slots a plan must allow: --expert-slots, or with --rebalance-every alone one
    per expert (the slots' layout rules still apply), else 0 (none)."""
    return cfg.expert_slots or (model_cfg.n_experts if cfg.rebalance_every else 0)


def auto_plan_for(cfg, world_size: int, model_cfg, gpu: str = "") -> Plan:
    """The planner's fastest layout of `cfg`'s run on `world_size` processes, for `--cluster`
    or this machine (the cluster file `phalanx calibrate` wrote, else the preset of its GPU
    `gpu`, else `local`), with room for the run's expert slots. Deterministic: every process
    that asks gets the same plan."""
    return auto_plan(model_cfg, world_size=world_size, global_batch=cfg.global_batch, seq_len=cfg.seq_len,
                     cluster=cfg.cluster or this_machine(gpu), dtype=cfg.dtype,
                     expert_slots=planned_expert_slots(cfg, model_cfg))


def plan_for_world(cfg, world_size: int, model_cfg, *, saved_world: int | None, elastic: bool = False,
                   gpu: str = "", log=None) -> tuple[Plan, str]:
    """(the plan for `world_size` processes, the `--plan` text the run records). The text is the
    user's own when it needs no change (empty for no plan), else the plan's string.
    `saved_world`: the world size of the checkpoint resumed from, if any; `log`: where the
    planner's choice for `--plan auto` is said."""
    if cfg.plan == "auto":
        plan = auto_plan_for(cfg, world_size, model_cfg, gpu)
        if log:
            log(f"phalanx: --plan auto chose {plan} for {world_size} process{'es' if world_size > 1 else ''}")
        return plan, plan.to_string()
    if not cfg.plan:
        return Plan(dp=world_size), ""  # dp over every process, whatever their number
    plan, _ = parse_plan(cfg.plan)
    changed = elastic or (saved_world is not None and saved_world != world_size)
    if plan.world_size == world_size or not changed:
        return plan, cfg.plan

    try:
        adapted = dp_follows(plan, world_size, cfg.global_batch).validate(world_size)
        validate_for_model(adapted, model_cfg, global_batch=cfg.global_batch, seq_len=cfg.seq_len, dtype=cfg.dtype,
                           compile=cfg.compile, float8=cfg.float8)
    except UserError as error:
        raise UserError(f"--plan {plan} cannot follow the world size to {world_size} processes ({error}); "
                        f"{_a_plan_that_fits(cfg, world_size, model_cfg, gpu)}") from None
    return adapted, adapted.to_string()


def _a_plan_that_fits(cfg, world_size: int, model_cfg, gpu: str) -> str:
    try:
        plan = auto_plan_for(cfg, world_size, model_cfg, gpu)
    except UserError as error:
        return f"and no plan fits: {error}"
    return f"a plan that fits: --plan {plan} (or --plan auto)"
