"""The training loop, run by every rank: one optimizer step per global batch."""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.adapt_policy import (
    AdaptRules, ShareGovernor, StragglerWatch, data_parallel_peers, equal_shares, share_rows,
)
from phalanx.data.batches import rank_batch, rank_documents
from phalanx.data.corpus import check_corpus, open_training_data
from phalanx.data.tokenizer import save_tokenizer_files
from phalanx.errors import UserError
from phalanx.hf.weights import initial_weights
from phalanx.local_device import pick_device
from phalanx.model.by_name import model_config
from phalanx.parallel.apply import parallelize
from phalanx.parallel.context_parallel import document_ids
from phalanx.parallel.data_parallel import set_gradient_sync
from phalanx.parallel.expert import expert_params
from phalanx.parallel.fault_tolerance import membership_events, replica_group, state_digest, writer_group
from phalanx.parallel.float8 import note_float8_device
from phalanx.parallel.grad_norm import clip_grad_norm
from phalanx.parallel.mesh import ParallelMesh, build_mesh
from phalanx.parallel.mixed_precision import autocast_for, release_before_step
from phalanx.parallel.tensor_parallel import loss_context
from phalanx.train import moe_aux_loss, moe_stats
from phalanx.train.bad_steps import BadStepCounter, injected_nan_steps, why_bad
from phalanx.checkpoint.store import latest_checkpoint, load_checkpoint
from phalanx.checkpoint.writer import CheckpointWriter
from phalanx.train.collective_watch import (
    StuckRankWatch, bound_every_group, raise_if_collective_failure, stall_if_asked,
)
from phalanx.train.config import TrainConfig
from phalanx.train.expert_load_plot import plot_expert_load
from phalanx.train.expert_slot_training import SlotTraining, slot_placements
from phalanx.train.metrics import MetricsLog, plot_loss, prepare_metrics
from phalanx.train.pipeline_step import (
    WaitClock, bubble_record, make_pipeline, pipeline_forward_loss, pipeline_next_logits, pipeline_step,
)
from phalanx.train.loss import token_loss
from phalanx.train.lr_schedule import lr_at
from phalanx.train.progress import Progress
from phalanx.train.rank_clock import RankClock
from phalanx.train.job import Job
from phalanx.train.resume_point import agreed_job
from phalanx.train.restarts import inject_fault, restart_count, restart_row
from phalanx.train.sample import generate
from phalanx.train.step_sync import StepAgreement, StepSync
from phalanx.train.stop_signal import StopSignals

EVAL_SEED = 7919
"""Validation windows use their own seed, the same for every run and every step."""


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


def batch_loss(model, inputs: torch.Tensor, targets: torch.Tensor, autocast) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the batch (under tensor parallelism,
    a replicated DTensor computed from vocabulary-sharded logits; run in `loss_context`)."""
    with autocast():
        logits = model(inputs)  # (batch, seq, vocab)
    return token_loss(logits, targets)


def _plain(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def step_documents(starts, tokens, cfg: TrainConfig, mesh: ParallelMesh, *, seed: int, step: int, rows=None):
    """With `--doc-mask`, the document ids of this rank's sequences of `step` (else None);
    `rows`: this rank's rows of the global batch when the shares are uneven."""
    if not cfg.doc_mask:
        return None
    return rank_documents(starts, len(tokens), seed=seed, step=step, global_batch=cfg.global_batch, seq_len=cfg.seq_len,
                          dp_rank=mesh.batch_rank, dp_size=mesh.batch_ranks, rows=rows)


@torch.no_grad()
def evaluate(model, tokens, cfg: TrainConfig, mesh: ParallelMesh, autocast, pipeline=None, documents=None) -> float:
    """`documents`: where the documents of `tokens` start, for `--doc-mask`."""
    model.eval()
    total = torch.zeros((), device=mesh.device)
    for i in range(cfg.eval_batches):
        inputs, targets = rank_batch(
            tokens, seed=EVAL_SEED, step=i, global_batch=cfg.global_batch, seq_len=cfg.seq_len,
            dp_rank=mesh.batch_rank, dp_size=mesh.batch_ranks, cp=mesh.cp, cp_rank=mesh.cp_rank,
        )
        inputs, targets = inputs.to(mesh.device), targets.to(mesh.device)
        ids = step_documents(documents, tokens, cfg, mesh, seed=EVAL_SEED, step=i)
        if pipeline is not None:
            total += pipeline_forward_loss(model, mesh, inputs, targets, autocast=autocast, documents=ids)
        else:
            with loss_context(mesh.plan), document_ids(ids):
                total += _plain(batch_loss(model, inputs, targets, autocast))
    model.train()
    return float(mesh.all_reduce_mean(total / cfg.eval_batches))


def skip_step(metrics, step: int, reason: str, bad_steps: BadStepCounter, cfg: TrainConfig, save, rank: int) -> None:
    """Report a skipped step; past --max-bad-steps in a row, checkpoint the last good state
    (the weights have not moved since it) and stop. A skipped step is not checkpointed: its
    state is the last good step's, saved under that step when the run stops or ends."""
    if metrics:
        metrics.write({"event": "skipped", "step": step, "reason": reason})
    if rank == 0:
        print(f"phalanx: warning: step {step} skipped: {reason}", file=sys.stderr)
    stop = bad_steps.bad()
    if stop or step == cfg.steps:
        last_good = step - bad_steps.in_a_row
        saved = save(last_good)[1]
    if stop:
        where = f"the last good state, step {last_good}, is checkpointed" if saved else "its weights are not finite, so no checkpoint was written"
        raise UserError(f"stopped at step {step}: {bad_steps.in_a_row} steps in a row had a non-finite loss or "
                        f"gradient norm (last: {reason}; --max-bad-steps {cfg.max_bad_steps}); {where}; try a lower --lr")


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


def step_record(step: int, agreed: StepAgreement, lr: float, grad_norm: float, step_time: float, *, tokens: int,
                mesh: ParallelMesh, clock: WaitClock | None) -> dict:
    """The metrics.jsonl row of a step, before its MoE, validation and checkpoint fields.
    Collective over the pp group with pipelines (the measured bubble)."""
    record = {
        "step": step, "loss": agreed.loss, "lr": lr, "grad_norm": grad_norm,
        "step_time_s": step_time, "tokens_per_s": tokens / step_time, "peak_mem_mb": peak_memory_mb(mesh.device),
    }
    if agreed.peak_mb_by_rank is not None:  # from the step's agreement (step_sync.py)
        record["peak_mem_mb_by_rank"] = agreed.peak_mb_by_rank
    if agreed.compute_s_by_rank is not None:  # what each counts: rank_clock.py
        record["compute_s_by_rank"], record["wait_s_by_rank"] = agreed.compute_s_by_rank, agreed.wait_s_by_rank
    if clock is not None:  # pipelined: the time this step waited on transfers
        record.update(bubble_record(clock, step_time, mesh.plan, mesh))
    return record


def adapt_events(step: int, agreed: StepAgreement, governor: ShareGovernor | None, stragglers: StragglerWatch,
                 speeds: Callable[[int], Sequence[float]] | None) -> list[dict]:
    """The step's `straggler` and `adapt` event rows; the governor's new shares apply from the
    next step. Every rank runs this on the same agreed figures, so all decide alike."""
    computes = agreed.compute_s_by_rank
    if computes is None:
        return []
    events = stragglers.observe(step, computes)
    if governor is not None:  # plain dp only: global rank = dp rank
        measured = [n / c if c > 0 else 0.0 for n, c in zip(governor.shares, computes)]
        if event := governor.observe(step, list(speeds(step)) if speeds else measured):
            events.append(event)
    return events


def resume_every_group_lost(groups, run_dir: Path, model, optimizer, metrics) -> int:
    """A restarted replica group whose first quorum found no group ahead of it: every group
    failed (or the others finished): as a restart of the whole run, it goes on from the newest
    checkpoint, if there is one (the step to run). A group restart does not read it before its
    first quorum: when a peer is alive it is not needed, and the peer may prune it meanwhile."""
    found = latest_checkpoint(run_dir)
    if found is None:
        return 0
    step = load_checkpoint(found[1], model, optimizer)
    groups.set_step(step)
    if metrics:  # the rows past it are written again, as after any resume
        prepare_metrics(metrics.path, step)
    return step


def train(job: Job | TrainConfig, run_dir: Path, stop: StopSignals | None = None, *,
          speeds: Callable[[int], Sequence[float]] | None = None) -> TrainResult:
    """Train on this rank. With a process group, every rank of the group must call this.
    `job`: the run worked out by the launcher (`phalanx.train.job`); given settings instead (a
    user's torchrun, an elastic launch, tests and benchmarks), rank 0 works the job out here
    and every rank receives it (`resume_point.agreed_job`). `stop`: the worker's signal
    handlers; a SIGTERM or SIGINT they note stops every rank after the same step, with a
    checkpoint. `speeds`: a test hook, step -> the per-rank speeds (sequences per second) the
    data-parallel shares adapt to after that step, in place of the measured ones (the same on
    every rank)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if isinstance(job, TrainConfig):
        job = agreed_job(job, run_dir)
    if job.world_size != world_size:
        raise UserError(f"the run was planned for {job.world_size} processes, but {world_size} were started")
    cfg, plan, found = job.settings, job.plan, job.resume_from
    model_cfg = model_config(cfg.model)
    accum = job.microbatches  # gradient-accumulation micro-batches per dp rank
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
    autocast = autocast_for(plan, cfg.dtype, device)  # only for param_dtype=fp32 under --dtype bf16

    micro = job.microbatch_size
    placements = slot_placements(cfg, model_cfg, plan)  # --expert-slots / --rebalance-every, else None
    model = parallelize(model_cfg, mesh, seed=cfg.seed, seq_len=cfg.seq_len, microbatch_tokens=micro * cfg.seq_len,
                        weights=initial_weights(cfg.model, cfg.init, model_cfg), expert_slots=placements,
                        compile=cfg.compile, float8=cfg.float8, doc_mask=cfg.doc_mask)
    pipeline = make_pipeline(model, mesh) if plan.pp > 1 else None
    if pipeline is not None:
        moe_aux_loss.aux_losses_in_backward(model)  # the schedule's loss_fn cannot see them
    optimizer = make_optimizer(model, cfg)
    slots = SlotTraining(model, placements, cfg.rebalance_every) if placements else None

    start_step, result = 0, TrainResult(run_dir=run_dir, model=model)
    if found:
        if slots is not None:  # the saved placement first: each rank then loads its slots' experts
            slots.load_state(found.meta.get("expert_slots"))
        start_step = load_checkpoint(Path(found.path), model, optimizer)
    replicas = cfg.replica_groups > 1
    metrics = (MetricsLog(run_dir / "metrics.jsonl", resume_step=start_step if found else None, shared=replicas)
               if rank == 0 else None)
    if metrics and not replicas and (row := restart_row(start_step)):  # a group's restart: its rows say so
        metrics.write(row)
    progress = Progress(total=cfg.steps, start=start_step, enabled=cfg.progress and rank == 0)
    nan_steps, bad_steps = injected_nan_steps(), BadStepCounter(cfg.max_bad_steps)
    meta = {"model": model_cfg.to_dict(), "train": dataclasses.asdict(cfg), "world_size": world_size}
    if slots is not None:
        meta["expert_slots"] = slots.state_dict()  # kept current below: each checkpoint holds its placement

    writer = CheckpointWriter(run_dir, model, optimizer, device=device, rank=rank, keep=cfg.keep_checkpoints, meta=meta,
                              asynchronous=not cfg.sync_checkpoint, timeout_s=cfg.collective_timeout)
    writer.last_saved = start_step if found else -1
    save = writer.save
    watch = StuckRankWatch(cfg.collective_timeout)  # names a stuck rank, only once a collective timed out
    bound_every_group(cfg.collective_timeout)  # the mesh's groups too, not only the default one
    sync = StepSync(device, stop)  # each step's one small collective: loss, stop signal, peak memory
    if rank == 0:
        save_tokenizer_files(corpus.tokenizer, run_dir)  # what the run's ids mean, for export and generation

    # Last before the loop: from here this group's torchft manager heartbeats, and the other groups'
    # quorums wait for it to ask (a second of TensorBoard's import in between stalled them all).
    groups = replica_group(cfg, model, optimizer, device, rank=rank, world=world_size, step=start_step, run_dir=run_dir,
                           first_attempt=not restart_count())
    # With replica groups, the data-parallel ranks of every group together read the global batch.
    batch_rank, batch_ranks = mesh.batch_rank, plan.dp
    if groups is not None:
        batch_rank, batch_ranks = groups.group * plan.dp + mesh.batch_rank, groups.groups * plan.dp
    hook_rank = rank if groups is None else groups.group * world_size + rank
    # Data-parallel shares of the global batch (sequences per dp rank), adapted to the ranks'
    # measured speeds when the job says so (phalanx/adapt_policy.py); equal otherwise.
    shares = job.shares or equal_shares(cfg.global_batch // cfg.replica_groups, plan.dp)
    governor = ShareGovernor(shares, job.adapt, minimum=accum) if job.adapt else None
    stragglers = StragglerWatch(job.adapt or AdaptRules(),  # each rank against the ranks doing its work
                                peers=data_parallel_peers(world_size, dp=plan.dp, cp=plan.cp, tp=plan.tp))
    rank_clock = RankClock(model, device)  # this rank's compute and wait seconds per step
    writes, members = True, None  # replica groups: whether this group writes the step; who took part in the last
    step = start_step
    try:
        while step < cfg.steps:
            # Test hooks (restarts.FAULT_ENV, collective_watch.STALL_ENV); ranks of replica groups count on.
            inject_fault(hook_rank, step)
            stall_if_asked(hook_rank, step + 1)
            if stopped := sync.stop_before_step():  # agreed by every rank in the last step's collective
                result.stopped_by = stopped
                if writes and writer.last_saved != step - bad_steps.in_a_row:  # skipped steps left the last good state
                    save(step - bad_steps.in_a_row)
                break
            if groups is not None:
                step = groups.begin_step()  # the quorum; a group that rejoins receives the live state and step here
                if step == 0 and not groups.healed_now and restart_count():
                    step = resume_every_group_lost(groups, run_dir, model, optimizer, metrics)
                if step >= cfg.steps:
                    break
            began = time.perf_counter()
            rank_clock.begin()
            lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            rows = share_rows(governor.shares, batch_rank) if governor else None  # None: the equal slice
            inputs, targets = rank_batch(
                corpus.train, seed=cfg.seed, step=step, global_batch=cfg.global_batch, seq_len=cfg.seq_len,
                dp_rank=batch_rank, dp_size=batch_ranks, cp=plan.cp, cp_rank=mesh.cp_rank, rows=rows,
            )
            inputs, targets = inputs.to(device), targets.to(device)  # (per_rank, seq / cp)
            documents = step_documents(corpus.train_documents, corpus.train, cfg, mesh, seed=cfg.seed, step=step, rows=rows)
            clock = WaitClock() if pipeline is not None else None
            if pipeline is not None:
                loss_sum = pipeline_step(pipeline, mesh, inputs, targets, autocast=autocast, clock=clock,
                                         documents=documents)
                rank_clock.add_wait(clock.seconds)
            else:
                loss_sum = torch.zeros((), device=device)
                parts = equal_shares(len(inputs), accum)  # sequences per micro-batch (uneven shares: +-1)
                for i in range(accum):
                    set_gradient_sync(model, i == accum - 1)
                    part = slice(*share_rows(parts, i))
                    # The micro-batch's mean times its fraction of the global batch, times the ranks
                    # the gradients are averaged over (dp x replica groups): summed over micro-batches
                    # and averaged over the ranks, the global batch's mean whatever the shares (the
                    # local sum over the global count, not the local mean). Equal shares: 1 / accum.
                    weight = (part.stop - part.start) * batch_ranks / cfg.global_batch
                    # The backward too: loss_parallel has its own, recomputation needs the documents.
                    with loss_context(plan), document_ids(None if documents is None else documents[part]):
                        loss = batch_loss(model, inputs[part], targets[part], autocast) * weight
                        rank_clock.backward(loss + moe_aux_loss.aux_loss(model) * weight)  # aux: MoE balance losses
                    loss_sum += _plain(loss.detach())
            if slots is not None:
                slots.sum_replica_grads()  # replicas of an expert take the same update
            if groups is not None:  # averaged over the groups present, before clipping, as in one process
                reduction = groups.reduce(list(model.parameters()), loss_sum)
                loss_sum = reduction.loss_sum
            grad_norm = clip_grad_norm(model.parameters(), cfg.grad_clip, pp_group=mesh.group("pp"),
                                       experts=expert_params(model))
            done = step + 1
            if done in nan_steps:
                loss_sum = loss_sum * float("nan")  # test hook: bad_steps.NAN_STEPS_ENV
            # With replica groups, their reduction above (waits for the other groups included) is compute.
            compute_s, wait_s = rank_clock.read()
            # The global batch's mean loss, every rank's figures; syncs the step.
            agreed = sync.agree(loss_sum, peak_memory_mb(device), compute_s, wait_s)
            if groups is not None:
                if not groups.commit():  # a group failed during the step: run it again with the next quorum
                    optimizer.zero_grad(set_to_none=True)
                    continue
                writes = writer_group(reduction) == groups.group
                if metrics and writes:
                    for row in membership_events(done, members, reduction):
                        metrics.write(row)
                members = reduction.groups
            for row in adapt_events(done, agreed, governor, stragglers, speeds):
                if metrics and writes:
                    metrics.write(row)
            loss_value = agreed.loss
            result.losses.append(loss_value)
            reason = why_bad(loss_value, grad_norm)  # both reduced over all ranks: every rank agrees
            if reason:
                optimizer.zero_grad(set_to_none=True)  # skipped: no update
                moe_stats.end_step(model, mesh, model_cfg)  # its counters restart with the next step
                skip_step(metrics if writes else None, done, reason, bad_steps, cfg,
                          save if writes else (lambda _step: (0.0, False)), rank)
                result.steps_done = step = done
                continue
            bad_steps.good()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            record = step_record(step + 1, agreed, lr, grad_norm, time.perf_counter() - began,
                                 tokens=cfg.global_batch * cfg.seq_len, mesh=mesh, clock=clock)
            if groups is not None:
                record["groups"] = reduction.groups
                state_digest(run_dir, groups.group, rank, done, model, optimizer)  # test hook: fault_tolerance.DIGEST_ENV
            record.update(moe_stats.end_step(model, mesh, model_cfg))  # expert loads; loss-free bias update
            if slots is not None and (event := slots.after_step(done, record.get("moe", {}), optimizer)) and metrics:
                metrics.write(event)  # slots moved to the new placement (weights and optimizer state)
            if slots is not None:
                meta["expert_slots"] = slots.state_dict()
            if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
                record["val_loss"] = result.val_loss = evaluate(model, corpus.val, cfg, mesh, autocast, pipeline,
                                                                    corpus.val_documents)
            # Saved before the row is written, so the row can say how long the loop waited on it.
            checkpoint_due = done == cfg.steps or (cfg.ckpt_every and done % cfg.ckpt_every == 0)
            record["ckpt_wait_s"] = save(done)[0] if checkpoint_due and writes else 0.0
            if metrics and writes:
                metrics.write(record)
            progress.update(record)
            result.steps_done = step = done
    except RuntimeError as error:
        raise_if_collective_failure(error, step + 1, cfg.collective_timeout, watch)
        raise
    finally:
        rank_clock.close()
        if metrics:
            metrics.close()  # flushes the TensorBoard event file
        writer.close(failing=sys.exc_info()[0] is not None)  # the last save completes before the run ends
        if groups is not None:
            groups.shutdown()
    progress.close()
    if result.stopped_by:
        return result  # the launcher says where to continue from
    if rank == 0 and cfg.plot and writes:
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
        plot_expert_load(run_dir / "metrics.jsonl", run_dir / "experts.png")
    if cfg.sample_tokens:
        result.sample = generate(
            model, cfg.sample_prompt, tokens=cfg.sample_tokens, max_seq_len=model_cfg.max_seq_len, device=device, seed=cfg.seed,
            pad_to=plan.tp if plan.sp else 1,
            next_logits=pipeline_next_logits(model, mesh, model_cfg.vocab_size) if pipeline is not None else None,
            tokenizer=corpus.tokenizer,
        )
    return result
