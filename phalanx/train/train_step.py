"""One optimizer step of a training run (`run_step`), on every rank, over the global batch.

The step reads the plan data it runs with from the `Run` (run_setup.py): the data-parallel
shares (`run.governor.shares`), the pipeline's split (the job's plan, which a re-split
replaces: stage_resplit.py). What it measures (each
rank's compute and wait seconds) reaches every rank in the step's one bookkeeping all-reduce,
and the adaptation policy (phalanx/adapt_policy.py) decides from it, alike on every rank.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

import torch

from phalanx.adapt_policy import ShareGovernor, SplitGovernor, StragglerWatch, equal_shares, share_rows
from phalanx.checkpoint.store import latest_checkpoint, load_checkpoint
from phalanx.data.batches import rank_batch, rank_documents
from phalanx.errors import UserError
from phalanx.parallel.context_parallel import document_ids
from phalanx.parallel.data_parallel import set_gradient_sync
from phalanx.parallel.expert import expert_params
from phalanx.parallel.fault_tolerance import membership_events, state_digest, writer_group
from phalanx.parallel.grad_norm import clip_grad_norm
from phalanx.parallel.mesh import ParallelMesh
from phalanx.parallel.tensor_parallel import loss_context
from phalanx.restart_timeline import mark
from phalanx.train import moe_aux_loss, moe_stats
from phalanx.train.bad_steps import BadStepCounter, why_bad
from phalanx.train.config import TrainConfig
from phalanx.train.expert_speeds import ep_speeds, measured_rank_speeds
from phalanx.train.loss import token_loss
from phalanx.train.lr_schedule import lr_at
from phalanx.train.metrics import prepare_metrics
from phalanx.train.pipeline_step import WaitClock, bubble_record, pipeline_forward_loss, pipeline_step
from phalanx.train.restarts import restart_count
from phalanx.train.run_setup import Run, peak_memory_mb
from phalanx.train.stage_resplit import resplit
from phalanx.train.step_sync import StepAgreement

EVAL_SEED = 7919
"""Validation windows use their own seed, the same for every run and every step."""


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
    if agreed.energy_j is not None:  # CUDA: the ranks' GPUs' joules since the last step's agreement (step_sync.py)
        record["energy_j"] = round(agreed.energy_j, 3)
    if clock is not None:  # pipelined: the time this step waited on transfers
        record.update(bubble_record(clock, step_time, mesh.plan, mesh))
    return record


def adapt_events(step: int, agreed: StepAgreement, governor: ShareGovernor | None, stragglers: StragglerWatch,
                 speeds: Callable[[int], Sequence[float]] | None, splitter: SplitGovernor | None = None,
                 stage_times: Callable[[int], Sequence[float]] | None = None, steps_left: int = 0) -> list[dict]:
    """The step's `straggler` and `adapt` event rows; the governor's new shares apply from the
    next step, the splitter's new split after this step's update (`stage_resplit.py`). Every
    rank runs this on the same agreed figures, so all decide alike."""
    computes = agreed.compute_s_by_rank
    if computes is None:
        return []
    events = stragglers.observe(step, computes)
    if governor is not None:  # plain dp only: global rank = dp rank
        measured = [n / c if c > 0 else 0.0 for n, c in zip(governor.shares, computes)]
        if event := governor.observe(step, list(speeds(step)) if speeds else measured):
            events.append(event)
    if splitter is not None and splitter.pending is None:
        if event := splitter.observe(step, list(stage_times(step)) if stage_times else computes, steps_left):
            events.append(event)
    return events


def resume_every_group_lost(groups, run_dir, model, optimizer, metrics) -> int:
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


def forward_backward(run: Run, inputs: torch.Tensor, targets: torch.Tensor, documents, clock: WaitClock | None) -> torch.Tensor:
    """This rank's forward and backward of its rows of the global batch; returns its share of
    the global batch's mean loss (summed over the dp ranks: the mean)."""
    if run.pipeline is not None:
        loss_sum = pipeline_step(run.pipeline, run.mesh, inputs, targets, autocast=run.autocast, clock=clock,
                                 documents=documents)
        run.rank_clock.add_wait(clock.seconds)
        return loss_sum
    loss_sum = torch.zeros((), device=run.device)
    parts = equal_shares(len(inputs), run.accum)  # sequences per micro-batch (uneven shares: +-1)
    for i in range(run.accum):
        set_gradient_sync(run.model, i == run.accum - 1)
        part = slice(*share_rows(parts, i))
        # The micro-batch's mean times its fraction of the global batch, times the ranks the
        # gradients are averaged over (dp x replica groups): summed over micro-batches and
        # averaged over the ranks, the global batch's mean whatever the shares (the local sum
        # over the global count, not the local mean). Equal shares: 1 / accum.
        weight = (part.stop - part.start) * run.batch_ranks / run.cfg.global_batch
        # The backward too: loss_parallel has its own, recomputation needs the documents.
        with loss_context(run.plan), document_ids(None if documents is None else documents[part]):
            loss = batch_loss(run.model, inputs[part], targets[part], run.autocast) * weight
            run.rank_clock.backward(loss + moe_aux_loss.aux_loss(run.model) * weight)  # aux: MoE balance losses
        loss_sum += _plain(loss.detach())
    return loss_sum


def batch_rows(run: Run) -> tuple[int, int] | None:
    """This rank's [start, stop) rows of the global batch: by the governor's shares when they
    adapt, else the plan's `shares=` kept as they are (`--no-adapt`); None: the equal slice."""
    shares = run.governor.shares if run.governor else run.job.shares
    return share_rows(shares, run.batch_rank) if shares else None


def stop_now(run: Run) -> bool:
    """Before a step: whether the run stops here (a stop signal every rank agreed on in the
    last step's collective, with a checkpoint; or, with replica groups, nothing left to do).
    With replica groups it also takes the quorum, which may hand this group another step."""
    if stopped := run.sync.stop_before_step():
        run.result.stopped_by = stopped
        last_good = run.step - run.bad_steps.in_a_row  # skipped steps left the last good state
        if run.writes and run.writer.last_saved != last_good:
            run.writer.save(last_good)
        return True
    if run.groups is not None:
        run.step = run.groups.begin_step()  # the quorum; a group that rejoins receives the live state and step here
        if run.step == 0 and not run.groups.healed_now and restart_count():
            run.step = resume_every_group_lost(run.groups, run.run_dir, run.model, run.optimizer, run.metrics)
        if run.step >= run.cfg.steps:
            return True
    return False


def run_step(run: Run) -> bool:
    """Run step `run.step + 1` on this rank (collective); False when the run stops instead.
    A step a replica group must run again (it received a peer's state during it) leaves `run.step` as it was."""
    cfg, device, step = run.cfg, run.device, run.step
    run.faults.before_step(run.hook_rank, step)  # test hooks (injected_faults.py)
    if stop_now(run):
        return False
    step = run.step
    began = time.perf_counter()
    run.rank_clock.begin()
    lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    clock = WaitClock() if run.pipeline is not None else None
    if run.groups is not None and run.groups.sitting_out:  # healed from peers in mid-step: they have its gradients
        loss_sum = torch.zeros((), device=device)
    else:
        rows = batch_rows(run)
        inputs, targets = rank_batch(
            run.corpus.train, seed=cfg.seed, step=step, global_batch=cfg.global_batch, seq_len=cfg.seq_len,
            dp_rank=run.batch_rank, dp_size=run.batch_ranks, cp=run.plan.cp, cp_rank=run.mesh.cp_rank, rows=rows,
        )
        inputs, targets = inputs.to(device), targets.to(device)  # (per_rank, seq / cp)
        documents = step_documents(run.corpus.train_documents, run.corpus.train, cfg, run.mesh, seed=cfg.seed, step=step,
                                   rows=rows)
        loss_sum = forward_backward(run, inputs, targets, documents, clock)
    if run.slots is not None:
        waited = time.perf_counter()
        run.slots.sum_replica_grads()  # replicas of an expert take the same update
        run.rank_clock.add_wait(time.perf_counter() - waited)  # a collective: the faster ranks wait in it
    if run.groups is not None:  # averaged over the groups present, before clipping, as in one process
        run.faults.after_backward(run.hook_rank, step + 1)  # test hook (injected_faults.IN_STEP_FAULT_ENV)
        reduction = run.groups.reduce(list(run.model.parameters()), loss_sum)  # and committed
        if reduction is None:  # this group received a peer's state meanwhile: the step runs again
            run.optimizer.zero_grad(set_to_none=True)
            return True
        run.rank_clock.add_wait(reduction.retry_s)  # a failed group's cost, not this rank's compute
        loss_sum = reduction.loss_sum
    grad_norm = clip_grad_norm(run.model.parameters(), cfg.grad_clip, pp_group=run.mesh.group("pp"),
                               experts=expert_params(run.model))
    done = step + 1
    if done in run.faults.nan_steps:
        loss_sum = loss_sum * float("nan")  # test hook (injected_faults.py)
    # With replica groups, their reduction above (waits for the other groups included) is compute.
    compute_s, wait_s = run.rank_clock.read()
    # The global batch's mean loss, every rank's figures; syncs the step.
    agreed = run.sync.agree(loss_sum, peak_memory_mb(device), compute_s, wait_s)
    if run.groups is not None:
        run.writes = writer_group(reduction) == run.groups.group
        if run.metrics and run.writes:
            for row in membership_events(done, run.members, reduction):
                run.metrics.write(row)
        run.members = reduction.groups
    for row in adapt_events(done, agreed, run.governor, run.stragglers, run.speeds, run.splitter, run.stage_times,
                            steps_left=cfg.steps - done):
        if run.metrics and run.writes:
            run.metrics.write(row)
    run.result.losses.append(agreed.loss)
    reason = why_bad(agreed.loss, grad_norm)  # both reduced over all ranks: every rank agrees
    if reason:
        run.optimizer.zero_grad(set_to_none=True)  # skipped: no update
        moe_stats.end_step(run.model, run.mesh, run.model_cfg)  # its counters restart with the next step
        skip_step(run.metrics if run.writes else None, done, reason, run.bad_steps, cfg,
                  run.writer.save if run.writes else (lambda _step: (0.0, False)), run.rank)
        run.result.steps_done = run.step = done
        return True
    run.bad_steps.good()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    retry_s = reduction.retry_s if run.groups is not None else 0.0  # a failed group's all-reduces and quorums
    record = step_record(done, agreed, lr, grad_norm, time.perf_counter() - began - retry_s,
                         tokens=cfg.global_batch * cfg.seq_len, mesh=run.mesh, clock=clock)
    if run.groups is not None:
        record["groups"] = reduction.groups
        if run.faults.state_digests and run.rank == 0:  # test probe (injected_faults.py)
            state_digest(run.run_dir, run.groups.group, done, run.model, run.optimizer)
    finish_step(run, done, record)
    mark("step_done", f"{done} {record['step_time_s']:.3f} {''.join(map(str, record.get('groups', [])))}")
    if run.splitter is not None and run.splitter.pending is not None:
        seconds = resplit(run, done)  # layers move between the stages; the next step runs the new split
        if run.metrics and seconds:
            run.metrics.write({"event": "resplit", "step": done, "split": run.plan.split, "seconds": round(seconds, 3)})
    return True


def expert_rank_speeds(run: Run, done: int, record: dict) -> list[float] | None:
    """Each ep rank's speed this step, for the slots' placement when the job adapts it
    (`expert_speeds.py`); the `speeds` test hook's figures instead when given."""
    if run.job.adapt_experts is None:
        return None
    if run.speeds is not None:
        per_rank = list(run.speeds(done))
    else:
        cfg = run.cfg
        per_rank = measured_rank_speeds(record.get("moe", {}), record.get("compute_s_by_rank"), model_cfg=run.model_cfg,
                                        seq_len=cfg.seq_len, tokens=cfg.global_batch * cfg.seq_len / run.world_size,
                                        cuda=run.device.type == "cuda")
    return None if per_rank is None else ep_speeds(per_rank, run.slots.ep)


def finish_step(run: Run, done: int, record: dict) -> None:
    """After a step's update: its expert loads and slot moves, validation, checkpoint and row."""
    cfg = run.cfg
    record.update(moe_stats.end_step(run.model, run.mesh, run.model_cfg))  # expert loads; loss-free bias update
    if run.slots is not None and (event := run.slots.after_step(done, record.get("moe", {}), run.optimizer,
                                                                speeds=expert_rank_speeds(run, done, record))) and run.metrics:
        run.metrics.write(event)  # slots moved to the new placement (weights and optimizer state)
    if run.slots is not None:
        run.meta["expert_slots"] = run.slots.state_dict()
    if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
        record["val_loss"] = run.result.val_loss = evaluate(run.model, run.corpus.val, cfg, run.mesh, run.autocast,
                                                            run.pipeline, run.corpus.val_documents)
    # Saved before the row is written, so the row can say how long the loop waited on it.
    checkpoint_due = done == cfg.steps or (cfg.ckpt_every and done % cfg.ckpt_every == 0)
    record["ckpt_wait_s"] = run.writer.save(done)[0] if checkpoint_due and run.writes else 0.0
    if run.metrics and run.writes:
        run.metrics.write(record)
    run.progress.update(record)
    run.result.steps_done = run.step = done
