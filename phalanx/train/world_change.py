"""A run that continues on another number of processes (a node lost, a rerun with another
--nproc, an elastic launch with --nnodes MIN:MAX): which plan it runs with.

- `--plan auto`: the planner's choice for the new world size.
- A user's plan: tp, pp, ep and every other key are kept and dp follows the world size; the
  number of micro-batches follows too, so each micro-batch keeps its size (what fitted in
  memory still fits) and the global batch is unchanged.
- When that cannot work (tp x pp does not divide the new world, dp no longer divides the global
  batch, ep no longer divides dp...), a one-line error names a plan that does: the planner's.

Only when the world size really changed (the checkpoint's differs, or the launch is elastic):
otherwise a plan that names another world size is the user's mistake, reported as before. The
checkpoint is resharded by DCP on load, and resume_settings.py logs the changed plan.
"""

from __future__ import annotations

from phalanx.errors import UserError
from phalanx.plan import Plan, parse_plan


def dp_follows(plan: Plan, world_size: int, global_batch: int) -> Plan:
    """`plan` with dp = world_size / (tp x pp) and micro-batches of the same size; UserError
    when tp x pp does not divide the world size."""
    if world_size % (plan.tp * plan.pp):
        raise UserError(f"tp={plan.tp} x pp={plan.pp} = {plan.tp * plan.pp} does not divide {world_size} processes")
    dp = world_size // (plan.tp * plan.pp)
    micro_size = max(1, global_batch // plan.dp // plan.num_microbatches)  # sequences per micro-batch before
    per_rank = global_batch // dp
    adapted = plan.replace(dp=dp)
    if per_rank % micro_size == 0 and per_rank // micro_size != adapted.num_microbatches:
        adapted = adapted.replace(microbatches=per_rank // micro_size)
    return adapted


def plan_for_world(cfg, world_size: int, model_cfg, *, saved_world: int | None, elastic: bool = False):
    """`cfg` with a plan for `world_size` processes (a TrainConfig; the same one when nothing
    changes). `saved_world`: the world size recorded in the checkpoint resumed from, if any."""
    if cfg.plan == "auto":
        from phalanx.launch import choose_auto_plan

        return choose_auto_plan(cfg, world_size)
    if not cfg.plan:
        return cfg  # dp over every process, whatever their number
    plan, _ = parse_plan(cfg.plan)
    changed = elastic or (saved_world is not None and saved_world != world_size)
    if plan.world_size == world_size or not changed:
        return cfg
    from phalanx.parallel.apply import validate_for_model

    try:
        adapted = dp_follows(plan, world_size, cfg.global_batch).validate(world_size)
        validate_for_model(adapted, model_cfg, global_batch=cfg.global_batch, seq_len=cfg.seq_len, dtype=cfg.dtype)
    except UserError as error:
        raise UserError(f"--plan {plan} cannot follow the world size to {world_size} processes ({error}); "
                        f"{_a_plan_that_fits(cfg, world_size, model_cfg)}") from None
    return cfg.replace(plan=adapted.to_string())


def _a_plan_that_fits(cfg, world_size: int, model_cfg) -> str:
    from phalanx.launch import planned_expert_slots
    from phalanx.planner.hardware import this_machine
    from phalanx.planner.search import auto_plan

    try:
        plan = auto_plan(model_cfg, world_size=world_size, global_batch=cfg.global_batch, seq_len=cfg.seq_len,
                         cluster=cfg.cluster or this_machine(""), dtype=cfg.dtype,
                         expert_slots=planned_expert_slots(cfg, model_cfg))
    except UserError as error:
        return f"and no plan fits: {error}"
    return f"a plan that fits: --plan {plan} (or --plan auto)"
