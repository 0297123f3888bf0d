"""A training run, worked out once: the plan it runs with, the checks it must pass before any
process computes, and where it starts. Torch-free at import; below both the launcher
(phalanx/train/launch.py, which works the job out before it starts a worker) and the training loop
(phalanx/train/loop.py, which receives it as data: `train(job, run_dir)`).

`resolve_job(settings, world_size, checkpoint)` decides, in this order:
  1. the sequence length fits the model;
  2. the resume decision: `--resume` (must) without a checkpoint is refused; the checkpoint
     resumed from is the one given (its step, folder and phalanx.json: `SavedCheckpoint`);
  3. the plan, parsed once: `--plan auto` decided by the planner (with room for the run's
     expert slots), no plan = dp over every process, a user's plan following a changed world
     size (`world_change.py`); then checked against the world size, the model, the batch and
     `--dtype` (`plan_model_checks.validate_for_model`, torch-free: parallel/ is not imported);
  4. the settings a resume may not change (`resume_settings.py`), and a line for each that did;
  5. the data-parallel shares the run starts with (the plan's `shares=`, else equal) and whether they adapt to the ranks'
     measured speeds (`adapt_policy.adaptation_refusal`: a line says why a layout does not);
     whether a pipeline's layers re-split between its stages from their measured times
     (`adapt_policy.split_adaptation_refusal`; the split itself is the plan's `split`, on a
     resume the one the run had adapted to when it fits); whether
     the expert slots' placement weighs the ep ranks' measured speeds (with `--rebalance-every`).

Deterministic in its inputs, so a launcher, rank 0 of a user's torchrun, or every rank alike
gets the same job. The checkpoint is found by the caller (`resume_point.saved_checkpoint`):
finding it reads and checksums every file, which should happen once, not once per rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from phalanx.adapt_policy import AdaptRules, adaptation_refusal, equal_shares, split_adaptation_refusal
from phalanx.checkpoint.reader import no_checkpoint_reason
from phalanx.errors import UserError
from phalanx.model.by_name import model_config
from phalanx.plan import Plan, parse_shares, parse_split
from phalanx.plan_model_checks import validate_for_model
from phalanx.train.config import TrainConfig
from phalanx.train.resume_settings import check_resume
from phalanx.train.world_change import plan_for_world, planned_expert_slots


@dataclass(frozen=True)
class SavedCheckpoint:
    """The checkpoint a run resumes from: the step it holds, its folder and its phalanx.json."""
    step: int
    path: str
    meta: dict

    @property
    def world_size(self) -> int | None:
        """The number of processes that wrote it (a checkpoint of an older phalanx may lack it)."""
        return self.meta.get("world_size")


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything about a run that is decided before training starts; plain data (pickled to
    the workers)."""
    settings: TrainConfig
    """The run's settings; `settings.plan` is the `--plan` text the run records in its
    checkpoints: the planner's choice for `auto`, the adapted plan after a world-size change,
    else the user's own text (empty for none)."""
    world_size: int
    plan: Plan
    """The layout, validated for `world_size` processes and the model, with its precision
    filled in from `--dtype`."""
    plan_text: str
    """The layout as decided, before the precision defaults: what the launcher's log shows."""
    expert_slots: int = 0
    """Expert slots per MoE layer the plan was checked for (`--expert-slots`, or n_experts with
    `--rebalance-every` alone); 0 = none."""
    resume_from: SavedCheckpoint | None = None
    """The checkpoint to load, or None for a fresh run."""
    shares: tuple[int, ...] = ()
    """Sequences of the global batch per data-parallel rank at the start, in dp-rank order
    (`adapt_policy.share_rows`: which rows each reads); () = equal shares. The loop changes
    them as `adapt` decides."""
    adapt: AdaptRules | None = None
    """How the shares follow the ranks' speeds; None: they stay as they are (`--no-adapt`, or a
    layout that does not adapt yet)."""
    adapt_split: AdaptRules | None = None
    """How a pipeline's layers per stage (the plan's `split`, or the cost-balanced one when it
    has none) follow the stages' measured times; None: the split stays (`--no-adapt`, pp=1, or a
    layout that does not adapt it yet). The loop re-splits as `adapt` decides, into a new plan."""
    adapt_experts: AdaptRules | None = None
    """How the expert slots' re-placements (`--rebalance-every`) weigh each ep rank's measured
    speed as well as the experts' loads (`balance/rebalancer.py`, `speed_weighted.py`); None:
    loads alone (`--no-adapt`, or no rebalancing)."""

    @property
    def microbatches(self) -> int:
        """Micro-batches per optimizer step per data-parallel rank (gradient accumulation)."""
        return self.plan.num_microbatches

    @property
    def microbatch_size(self) -> int:
        """Sequences per micro-batch on each data-parallel rank (of every replica group: the
        groups' ranks share the global batch)."""
        return self.settings.global_batch // self.settings.replica_groups // self.plan.dp // self.microbatches

    @property
    def start_step(self) -> int:
        return self.resume_from.step if self.resume_from else 0


def _resumed_split(plan: Plan, saved: str | None, n_layers: int, log) -> Plan:
    """The plan with the split the checkpoint's run had adapted to (`stage_resplit.py` records
    it as `stage_split`), where it fits this plan's stages; else the plan as it is."""
    if not saved or saved == plan.split:
        return plan
    try:
        parse_split(saved, plan.pp * plan.virtual, n_layers)
    except UserError:
        return plan  # another number of stages: the plan's own split, measured again
    if log:
        log(f"phalanx: resuming with the pipeline split {saved} the run had adapted to (layers per stage)")
    return plan.replace(split=saved)


def planned_shares(plan: Plan, cfg: TrainConfig, model_cfg) -> tuple[int, ...]:
    """The plan's `shares=`, checked against the batch, and refused for layouts whose shares the
    trainer keeps equal (`adapt_policy.adaptation_refusal`: plain data parallelism only)."""
    why_not = adaptation_refusal(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, ep=plan.ep, sharded=plan.zero >= 2,
                                 replica_groups=cfg.replica_groups, compile=cfg.compile, moe=bool(model_cfg.n_experts))
    if why_not:
        raise UserError(f"shares={plan.shares}: uneven data-parallel shares are not run with this layout ({why_not})")
    return parse_shares(plan.shares, plan.dp, cfg.global_batch // cfg.replica_groups, plan.num_microbatches)


def check_sequence_length(cfg: TrainConfig, model_cfg) -> None:
    if cfg.seq_len > model_cfg.max_seq_len:
        raise UserError(f"seq_len={cfg.seq_len} exceeds model {cfg.model!r}'s max_seq_len={model_cfg.max_seq_len}")


def resolve_job(cfg: TrainConfig, world_size: int, checkpoint: SavedCheckpoint | None, *, run_dir: str,
                gpu: str = "", log=None) -> Job:
    """The job of `cfg` on `world_size` processes. `checkpoint`: the newest complete one in
    the run directory when `cfg.resume` asks for one (None: none there, or a fresh run);
    `gpu`: this machine's GPU name, for `--plan auto` without `--cluster`; `log`: called with
    each line to say (the planner's choice, what a resume changed), once per run."""
    model_cfg = model_config(cfg.model)
    check_sequence_length(cfg, model_cfg)
    if cfg.resume == "must" and checkpoint is None:

        raise UserError(f"--resume: {no_checkpoint_reason(Path(run_dir))} (--resume auto starts fresh when there is none)")
    plan, text = plan_for_world(cfg, world_size, model_cfg, saved_world=checkpoint.world_size if checkpoint else None,
                                elastic=cfg.elastic, gpu=gpu, log=log)
    cfg = cfg.replace(plan=text)
    shown = plan.validate(world_size).to_string()
    plan = validate_for_model(plan, model_cfg, global_batch=cfg.global_batch, seq_len=cfg.seq_len, dtype=cfg.dtype,
                              compile=cfg.compile, float8=cfg.float8, doc_mask=cfg.doc_mask,
                              replica_groups=cfg.replica_groups)
    if checkpoint is not None:
        notes = check_resume(checkpoint.meta, model=model_cfg.to_dict(), where=run_dir,
                             settings={**dataclasses.asdict(cfg), "world_size": world_size})
        for line in notes if log else ():
            log(line)
    adapt = None
    if cfg.adapt:
        why_not = adaptation_refusal(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, ep=plan.ep, sharded=plan.zero >= 2,
                                     replica_groups=cfg.replica_groups, compile=cfg.compile, moe=bool(model_cfg.n_experts))
        if not why_not:
            adapt = AdaptRules()
        elif plan.dp > 1 and log:
            log(f"phalanx: equal data-parallel shares (not adapted to the ranks' speeds): {why_not}")
    shares = equal_shares(cfg.global_batch // cfg.replica_groups, plan.dp) if adapt else ()
    if plan.shares:  # the plan's own start (the planner's for a mixed cluster), adapted or kept
        shares = planned_shares(plan, cfg, model_cfg)
    slots = planned_expert_slots(cfg, model_cfg)
    adapt_split = None
    if cfg.adapt:
        why_not = split_adaptation_refusal(pp=plan.pp, schedule=plan.schedule, replica_groups=cfg.replica_groups,
                                           compile=cfg.compile, expert_slots=slots)
        if not why_not:
            adapt_split = AdaptRules()
        elif plan.pp > 1 and log:
            log(f"phalanx: the pipeline's split stays as planned (not adapted to the stages' speeds): {why_not}")
    if adapt_split is not None and checkpoint is not None:
        plan = _resumed_split(plan, checkpoint.meta.get("stage_split"), model_cfg.n_layers, log)
    return Job(settings=cfg, world_size=world_size, plan=plan, plan_text=shown, expert_slots=slots,
               resume_from=checkpoint, shares=shares, adapt=adapt, adapt_split=adapt_split,
               adapt_experts=AdaptRules() if cfg.adapt and cfg.rebalance_every and model_cfg.n_experts else None)
