"""A training run's setup: everything the steps share, built once per rank before the first
step (`set_up`), and the parts a pipeline re-split builds again (`build_model`).

`Run` holds it: the job (plain data: the plan, the shares), the mesh, the data, the model and
its optimizer, the checkpoint writer, the step's bookkeeping, and the adaptation policy's
state. `train_step.run_step` reads and updates it one step at a time; `loop.train` ties the
three (setup, steps, end) together.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.adapt_policy import (
    AdaptRules, ShareGovernor, SplitGovernor, StragglerWatch, data_parallel_peers, equal_shares,
)
from phalanx.checkpoint.store import load_checkpoint
from phalanx.checkpoint.writer import CheckpointWriter
from phalanx.data.corpus import check_corpus, open_training_data
from phalanx.data.tokenizer import save_tokenizer_files
from phalanx.errors import UserError
from phalanx.hf.weights import initial_weights
from phalanx.local_device import pick_device
from phalanx.model.by_name import model_config
from phalanx.parallel.apply import parallelize
from phalanx.parallel.fault_tolerance import GROUP_ENV, replica_group
from phalanx.parallel.float8 import note_float8_device
from phalanx.parallel.mesh import ParallelMesh, build_mesh
from phalanx.parallel.mixed_precision import autocast_for, release_before_step
from phalanx.parallel.stage_split import stage_layer_counts, unit_costs
from phalanx.restart_timeline import mark
from phalanx.train import moe_aux_loss
from phalanx.train.bad_steps import BadStepCounter
from phalanx.train.collective_watch import StuckRankWatch, bound_every_group
from phalanx.train.config import TrainConfig
from phalanx.train.expert_slot_training import SlotTraining, slot_placements
from phalanx.train.gpu_energy import EnergyCounter, counter_for
from phalanx.train.injected_faults import InjectedFaults
from phalanx.train.job import Job
from phalanx.train.metrics import MetricsLog
from phalanx.train.pipeline_step import make_pipeline
from phalanx.train.progress import Progress
from phalanx.train.rank_clock import RankClock
from phalanx.train.restarts import restart_count, restart_row
from phalanx.train.resume_point import agreed_job
from phalanx.train.step_sync import StepSync
from phalanx.train.stop_signal import StopSignals


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    """Global-batch mean loss of each step this process ran (after a resume: from there)."""
    val_loss: float | None = None
    sample: str = ""
    stopped_by: int = 0
    """The signal (SIGTERM, SIGINT) that stopped the run after a checkpoint; 0 if none did."""
    steps_done: int = 0
    model: object = None
    """The trained (parallelized) model, for tests that compare weights."""


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def energy_counter(device: torch.device, rank: int) -> EnergyCounter | None:
    """NVML's energy counter of this rank's GPU, whose readings give each step's `energy_j`
    (step_sync.py); None on CPU (nothing read there) and where it cannot be read (rank 0 says
    why, once: the rows then have no `energy_j`)."""
    if device.type != "cuda":
        return None
    try:
        counter, why = counter_for(str(torch.cuda.get_device_properties(device).uuid))
    except Exception as error:  # a measurement never stops a run: an NVML binding unlike pynvml's, say so
        counter, why = None, f"reading NVML failed ({type(error).__name__}: {error})"
    if counter is None and rank == 0:
        print(f"phalanx: note: no energy_j in metrics.jsonl: {why}", file=sys.stderr)
    return counter


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the fp32 (master) weights, with fp32 moments, no weight decay on vectors
    (norms, biases); in bf16 it drops the step's compute copies before it steps."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    release_before_step(optimizer, model)
    return optimizer


@dataclass(kw_only=True)
class Run:
    """One rank's training run between setup and end (see the module docstring)."""
    job: Job
    run_dir: Path
    rank: int
    world_size: int
    device: torch.device
    mesh: ParallelMesh
    model_cfg: object
    corpus: object
    autocast: Callable
    placements: object
    """The expert slots' placement (`--expert-slots` / `--rebalance-every`), else None."""
    faults: InjectedFaults
    speeds: Callable[[int], Sequence[float]] | None
    """Test hook: step -> per-rank speeds in place of the measured ones (`train`'s docstring)."""
    stage_times: Callable[[int], Sequence[float]] | None
    """Test hook: step -> every rank's compute seconds, what the pipeline's split adapts to in
    place of the measured ones."""
    model: torch.nn.Module = None
    pipeline: object = None
    optimizer: torch.optim.Optimizer = None
    slots: SlotTraining | None = None
    rank_clock: RankClock = None
    result: TrainResult = None
    metrics: MetricsLog | None = None
    progress: Progress = None
    bad_steps: BadStepCounter = None
    meta: dict = field(default_factory=dict)
    writer: CheckpointWriter = None
    watch: StuckRankWatch = None
    sync: StepSync = None
    groups: object = None
    """The replica group's torchft manager (`--replica-groups`), else None."""
    batch_rank: int = 0
    batch_ranks: int = 1
    hook_rank: int = 0
    """This rank's number for the injected faults: across replica groups, groups count on."""
    governor: ShareGovernor | None = None
    splitter: SplitGovernor | None = None
    """The pipeline's layers per stage, when they adapt (`Job.adapt_split`)."""
    stragglers: StragglerWatch = None
    writes: bool = True
    """Replica groups: whether this group writes the step's rows and checkpoints."""
    members: list | None = None
    """Replica groups: who took part in the last step."""
    step: int = 0
    """Steps done."""

    @property
    def cfg(self) -> TrainConfig:
        return self.job.settings

    @property
    def plan(self):
        return self.job.plan

    @property
    def accum(self) -> int:
        """Gradient-accumulation micro-batches per dp rank."""
        return self.job.microbatches


def build_model(run: Run) -> None:
    """The model of `run.job.plan` (parallelized), its pipeline schedule when pp > 1, its
    optimizer and its rank clock: at setup, and again after a pipeline re-split (whose new
    split is in the plan). Weights are the run's initial ones; a checkpoint load follows."""
    cfg, plan = run.cfg, run.plan
    micro = run.job.microbatch_size
    run.model = parallelize(run.model_cfg, run.mesh, seed=cfg.seed, seq_len=cfg.seq_len,
                            microbatch_tokens=micro * cfg.seq_len, weights=initial_weights(cfg.model, cfg.init, run.model_cfg),
                            expert_slots=run.placements, compile=cfg.compile, float8=cfg.float8, doc_mask=cfg.doc_mask)
    run.pipeline = make_pipeline(run.model, run.mesh) if plan.pp > 1 else None
    if run.pipeline is not None:
        moe_aux_loss.aux_losses_in_backward(run.model)  # the schedule's loss_fn cannot see them
    run.optimizer = make_optimizer(run.model, cfg)
    if run.rank_clock is not None:
        run.rank_clock.close()
    run.rank_clock = RankClock(run.model, run.device)  # this rank's compute and wait seconds per step
    if run.result is not None:
        run.result.model = run.model


def split_governor(job: Job, model_cfg) -> SplitGovernor | None:
    """The pipeline split's governor when the job adapts it (`Job.adapt_split`), else None:
    the stages' costs and layer counts as `parallelize` splits them (`stage_split.py`)."""
    if job.adapt_split is None:
        return None
    plan, cfg = job.plan, job.settings
    tokens = job.microbatch_size * cfg.seq_len
    counts = stage_layer_counts(model_cfg, plan.pp, split=plan.split, seq_len=cfg.seq_len, tokens_per_microbatch=tokens)
    per_stage = job.world_size // plan.pp  # rank = (pp_rank x dp + dp_rank) x cp x tp + ...: docs/layout.md
    return SplitGovernor(tuple(counts), tuple(unit_costs(model_cfg, cfg.seq_len, tokens)),
                         ranks=[list(range(p * per_stage, (p + 1) * per_stage)) for p in range(plan.pp)],
                         rules=job.adapt_split)


def slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds` (collective), so that every rank decides alike."""
    if not dist.is_initialized():
        return seconds
    value = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def set_up(job: Job | TrainConfig, run_dir: Path, stop: StopSignals | None, *, faults: InjectedFaults,
           speeds=None, stage_times=None) -> Run:
    """Everything before the first step, on every rank (collective)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if isinstance(job, TrainConfig):
        job = agreed_job(job, run_dir)
    if job.world_size != world_size:
        raise UserError(f"the run was planned for {job.world_size} processes, but {world_size} were started")
    began = time.perf_counter()
    cfg, plan, found = job.settings, job.plan, job.resume_from
    model_cfg = model_config(cfg.model)
    device = pick_device(cfg.device)
    note_float8_device(device, cfg.float8, rank)  # refused on a GPU without float8 matmuls
    mesh = build_mesh(plan, device)
    corpus = open_training_data(data=cfg.data, tokenizer=cfg.tokenizer, model=cfg.model)
    check_corpus(corpus, model=cfg.model, model_vocab=model_cfg.vocab_size, seq_len=cfg.seq_len, needs_val=cfg.eval_every > 0,
                 doc_mask=cfg.doc_mask)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)  # only now: a data error leaves no empty run folder
    except OSError as error:
        raise UserError(f"--out {run_dir}: cannot create the run directory ({error.strerror})") from None
    run = Run(job=job, run_dir=run_dir, rank=rank, world_size=world_size, device=device, mesh=mesh, model_cfg=model_cfg,
              corpus=corpus, autocast=autocast_for(plan, cfg.dtype, device),  # only for param_dtype=fp32 under --dtype bf16
              placements=slot_placements(cfg, model_cfg, plan), faults=faults, speeds=speeds, stage_times=stage_times)
    build_model(run)
    mark("model_built")
    run.slots = (SlotTraining(run.model, run.placements, cfg.rebalance_every, speed_rules=job.adapt_experts)
                 if run.placements else None)

    run.result = TrainResult(run_dir=run_dir, model=run.model)
    if found:
        if run.slots is not None:  # the saved placement first: each rank then loads its slots' experts
            run.slots.load_state(found.meta.get("expert_slots"))
        run.step = load_checkpoint(Path(found.path), run.model, run.optimizer)
    replicas = cfg.replica_groups > 1
    run.metrics = (MetricsLog(run_dir / "metrics.jsonl", resume_step=run.step if found else None, shared=replicas)
                   if rank == 0 else None)
    if run.metrics and not replicas and (row := restart_row(run.step)):  # a group's restart: its rows say so
        run.metrics.write(row)
    run.progress = Progress(total=cfg.steps, start=run.step, enabled=cfg.progress and rank == 0)
    run.bad_steps = BadStepCounter(cfg.max_bad_steps)
    run.meta = {"model": model_cfg.to_dict(), "train": dataclasses.asdict(cfg), "world_size": world_size}
    if run.slots is not None:
        run.meta["expert_slots"] = run.slots.state_dict()  # kept current by the steps: each checkpoint holds its placement

    run.writer = CheckpointWriter(run_dir, run.model, run.optimizer, device=device, rank=rank, keep=cfg.keep_checkpoints,
                                  meta=run.meta, asynchronous=not cfg.sync_checkpoint, timeout_s=cfg.collective_timeout,
                                  die_in_save=faults.die_in_save)
    run.writer.last_saved = run.step if found else -1
    run.watch = StuckRankWatch(cfg.collective_timeout)  # names a stuck rank, only once a collective timed out
    bound_every_group(cfg.collective_timeout)  # the mesh's groups too, not only the default one
    # Each step's one small collective: loss, stop signal, peak memory, times, GPU energy.
    run.sync = StepSync(device, stop, energy=energy_counter(device, rank))
    if rank == 0:
        save_tokenizer_files(corpus.tokenizer, run_dir)  # what the run's ids mean, for export and generation
    # Data-parallel shares of the global batch (sequences per dp rank), adapted to the ranks'
    # measured speeds when the job says so (phalanx/adapt_policy.py); equal otherwise.
    shares = job.shares or equal_shares(cfg.global_batch // cfg.replica_groups, plan.dp)
    run.governor = ShareGovernor(shares, job.adapt, minimum=run.accum) if job.adapt else None
    run.stragglers = StragglerWatch(job.adapt or AdaptRules(),  # each rank against the ranks doing its work
                                    peers=data_parallel_peers(world_size, dp=plan.dp, cp=plan.cp, tp=plan.tp))

    run.splitter = split_governor(job, model_cfg)
    if run.splitter is not None:  # a re-split repeats this setup's work; until one is measured, its cost
        run.splitter.cost_s = slowest(time.perf_counter() - began, device)

    # Last: from here this group's torchft manager heartbeats, and the other groups' quorums
    # wait for it to ask (a second of TensorBoard's import in between stalled them all).
    if cfg.replica_groups > 1:  # test hook (injected_faults.REJOIN_STALL_ENV)
        faults.before_rejoin(int(os.environ[GROUP_ENV]) * world_size + rank)
    mark("manager_start")
    run.groups = replica_group(cfg, run.model, run.optimizer, device, rank=rank, world=world_size, step=run.step,
                               run_dir=run_dir, first_attempt=not restart_count())
    mark("manager_up")
    # With replica groups, the data-parallel ranks of every group together read the global batch.
    run.batch_rank, run.batch_ranks = mesh.batch_rank, plan.dp
    run.hook_rank = rank
    if run.groups is not None:
        run.batch_rank, run.batch_ranks = run.groups.group * plan.dp + mesh.batch_rank, run.groups.groups * plan.dp
        run.hook_rank = run.groups.group * world_size + rank
    return run

