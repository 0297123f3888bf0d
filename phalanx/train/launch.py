"""Starting the worker processes of `phalanx train`.

- Under an external `torchrun` (RANK and WORLD_SIZE set), this process is one worker.
- `--nproc 1` runs in this process, with no process group (unless `--max-restarts` asks for restarts).
- `--nproc N` starts N local workers through PyTorch's elastic launcher (the machinery of
  `torchrun`), rendezvous on 127.0.0.1 unless `--rdzv-endpoint` says otherwise, and starts
  them again after a failure (`--max-restarts`), both by the one launcher of every command
  (phalanx/launch/worker_launch.py) and its restart policy (phalanx/launch/restart_policy.py).
- SIGTERM and SIGINT stop every worker after the same step, with a checkpoint
  (phalanx/train/stop_signal.py); `report_stop` says how to continue.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from phalanx.checkpoint.store import latest_checkpoint
from phalanx.data.corpus import check_corpus, open_training_data
from phalanx.errors import UserError
from phalanx.hf.weights import initial_weights
from phalanx.model.by_name import model_config
from phalanx.model.init import build_model
from phalanx.plan import parse_plan
from phalanx.launch.restart_policy import max_restarts
from phalanx.train.config import TrainConfig
from phalanx.train.injected_faults import InjectedFaults  # test hooks, read once here
from phalanx.train.job import Job, check_sequence_length, resolve_job
from phalanx.train.loop import train
from phalanx.train.replica_groups import GROUP_ENV, check_group_job, claim_node, group_processes, launch_replica_groups
from phalanx.train.restarts import leave_user_error, resume_mode
from phalanx.train.resume_point import gpu_name, saved_checkpoint
from phalanx.train.stop_signal import GRACE_S, STOP_STATUS, StopSignals
from phalanx.worker_group import check_nproc, run_in_group, usable_cores
from phalanx.launch.worker_launch import launch_workers

TEARDOWN_WAIT_S = 1.0
"""How long a worker that raised waits for the agent's SIGTERM before reporting its own error
(the agent polls its workers every 0.1 s)."""


def default_nproc(cfg: TrainConfig) -> int:
    """Workers per node when --nproc is not given: as many as the plan names (divided among the
    --nnodes); else one per GPU; else one per CPU core (at most 8), lowered until it divides
    the global batch."""
    if cfg.plan and cfg.plan != "auto":  # over every node: --nproc is per node
        return max(1, parse_plan(cfg.plan)[0].world_size // cfg.node_range[1])
    if cfg.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    nproc = min(usable_cores(), 8)
    while cfg.global_batch % nproc:
        nproc -= 1
    return nproc


def resolve_run_dir(cfg: TrainConfig) -> Path:
    if cfg.out:
        return Path(cfg.out)

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{model_config(cfg.model).name}-{stamp}"


def _summary(result, cfg: TrainConfig, seconds: float) -> str:
    ran = len(result.losses)  # one per step this run took (a resumed run starts past step 0)
    if ran == result.steps_done:
        lines = [f"done: {ran} steps in {seconds:.0f} s"]
    else:
        lines = [f"done: step {result.steps_done}, {ran} step{'s' if ran != 1 else ''} in this run "
                 f"(from step {result.steps_done - ran}) in {seconds:.0f} s"]
    if result.losses:
        lines.append(f"  train loss   {result.losses[-1]:.3f} (first step of this run: {result.losses[0]:.3f})")
    if result.val_loss is not None:
        lines.append(f"  val loss     {result.val_loss:.3f}")
    if result.sample:
        lines.append("  sample:\n" + "\n".join("    | " + line for line in result.sample.splitlines()))
    extra = ", experts.png" if (result.run_dir / "experts.png").exists() else ""  # MoE load heat-map
    lines.append(f"  run files    {result.run_dir}/ (metrics.jsonl, loss.png{extra}, checkpoints/)")
    return "\n".join(lines)


def worker_main(cfg_fields: dict, run_dir: str, on_user_error=None, job: Job | None = None) -> int:
    """Entry point of every worker process; returns its exit status (STOP_STATUS when
    SIGTERM or SIGINT stopped the run after a checkpoint). `job`: the run as the launcher
    worked it out; None where only the workers know the world size (torchrun, an elastic
    launch): rank 0 works it out then, and every rank receives it."""
    cfg = TrainConfig(**cfg_fields)
    rank = int(os.environ.get("RANK", "0"))
    began = time.perf_counter()
    with StopSignals() as stop:  # from the first moment: a signal during setup stops after one step
        try:
            faults = InjectedFaults.from_env()
            result = run_in_group(cfg.device, lambda: train(job or cfg, Path(run_dir), stop=stop, faults=faults), on_user_error,
                                  datetime.timedelta(seconds=cfg.collective_timeout), threads=cfg.threads)
        except Exception as error:
            # When another worker died, this one's collective fails at once, and the agent,
            # seeing the dead one, stops this one within its monitor interval (SIGTERM). Wait
            # for that before exiting, so that the agent reports the worker that failed first,
            # and stay quiet: this worker's broken collective is only noise. A rank that saw a
            # connection close waits longer: another may still be naming a stuck rank.
            wait = TEARDOWN_WAIT_S + getattr(error, "others_may_name_s", 0.0)  # CollectiveTimeout's
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and stop.wait(wait):
                return 1
            raise
    if result is None:
        return 2
    if result.stopped_by:
        return STOP_STATUS[result.stopped_by]
    if rank == 0 and os.environ.get(GROUP_ENV, "0") == "0":  # one summary, not one per replica group
        print(_summary(result, cfg, time.perf_counter() - began))
    return 0


def node_worker(cfg_fields: dict, job: Job | None, run_dir: str) -> int:
    """Every worker the launcher starts (phalanx/launch/worker_launch.py runs it): `worker_main`, with
    the run directory's lock held by rank 0 across machines (there no launcher holds it: each
    would refuse the others')."""
    cfg = TrainConfig(**cfg_fields)
    # Replica groups are one local launch each: their machine's launcher holds the directory (`claim_node`).
    across_nodes = cfg.node_range[1] > 1 and cfg.replica_groups == 1 and os.environ.get("RANK") == "0"
    lock = lock_run_dir(Path(run_dir)) if across_nodes else None
    try:
        return worker_main(cfg_fields, run_dir, job=job)
    finally:
        if lock:
            lock.close()


def launch_with_restarts(cfg: TrainConfig, nproc: int, run_dir: str, rdzv_endpoint: str, restarts: int,
                         job_for=lambda cfg: None, *, group: int | None = None) -> int:
    """The workers under the one restart policy (phalanx/launch/restart_policy.py): each restart goes
    on from the newest checkpoint (`--resume auto`, its job worked out again by `job_for`), or,
    for a replica `group` (phalanx/train/replica_groups.py), from its peers' live state, which
    it receives at its first quorum. Across machines every launcher names the same run (each
    counts its attempts alike: a failure anywhere fails every node's workers)."""
    def args_for(attempt: int) -> tuple:
        settings = cfg if attempt == 0 else cfg.replace(resume="auto")
        return asdict(settings), job_for(settings), run_dir

    def restarting() -> str:
        if group is not None:
            return "restarting from its peers' live state"
        found = latest_checkpoint(Path(run_dir))
        return f"restarting from step {found[0]}" if found else "restarting from the start (no checkpoint yet)"

    nodes = cfg.node_range if group is None else (1, 1)  # a replica group's workers are on one machine
    run = f"phalanx-{rdzv_endpoint}" if nodes[1] > 1 else f"phalanx-{os.getpid()}"
    return launch_workers(node_worker, args_for, nproc, cfg.device, restarts,
                          label="" if group is None else f"replica group {group}: ", restarting=restarting,
                          after=lambda: resume_hint(Path(run_dir)), rdzv_endpoint=rdzv_endpoint, nodes=nodes,
                          grace_s=GRACE_S, run_id=run, warm=group is not None)


def resume_hint(run_dir: Path) -> str:
    found = latest_checkpoint(run_dir)
    if found is None:
        return "no checkpoint was written"
    return f"last checkpoint: step {found[0]}; continue with: phalanx train --out {run_dir} --resume auto"


def launch_train(cfg: TrainConfig, rdzv_endpoint: str = "") -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # already a worker of torchrun
        if not cfg.out:
            raise UserError("under torchrun, pass --out DIR (all ranks must agree on the run directory)")
        return _torchrun_worker(cfg)

    nproc = cfg.nproc or default_nproc(cfg)
    check_nproc(nproc, cfg.device)
    nodes = cfg.node_range
    if nodes[1] > 1 and not rdzv_endpoint and cfg.replica_groups == 1:  # replica groups meet at the lighthouse
        raise UserError(f"--nnodes {cfg.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every machine")
    per_group = group_processes(cfg, nproc) if cfg.replica_groups > 1 else 0  # each group runs the plan
    # Exact unless elastic: then the workers plan for the world they find (a replica group's world is fixed).
    world = per_group or nproc * nodes[0]
    # Fail here, in one line, not in every worker.
    model_cfg = model_config(cfg.model)
    check_sequence_length(cfg, model_cfg)
    run_dir = resolve_run_dir(cfg)
    node = None
    if per_group and nodes[1] > 1:  # this machine's slot, its groups (train/replica_groups.py)
        lock = lock_run_dir(run_dir, shared=True)  # the machines share it; a run of another kind is refused
        node = claim_node(run_dir, cfg, nproc)
        if node.joining:  # its groups receive the running groups' state: no checkpoint to read, none to refuse
            cfg = cfg.replace(resume="")
    # Checksummed once here (a whole checkpoint is read); a run without --out is a new directory.
    found = saved_checkpoint(run_dir, report=not cfg.elastic) if cfg.out and not (node and node.joining) else None
    cfg = cfg.replace(nproc=nproc, out=str(run_dir))

    def job_for(settings: TrainConfig, saved) -> Job | None:
        """The job the workers receive; None for an elastic launch, whose workers work it out
        for the world they find."""
        if settings.elastic and not per_group:
            return None
        return resolve_job(settings, world, saved if settings.resume else None, run_dir=str(run_dir),
                           gpu=gpu_name(settings), log=lambda line: print(line, file=sys.stderr))

    if not cfg.resume and found is not None:  # before the job: its resume decision assumes this
        raise UserError(f"{run_dir} already holds a run; pass --resume to continue it, or another --out")
    job = job_for(cfg, found)
    if job is not None:
        cfg = job.settings  # the plan as worked out: restarts go on with it, not with `auto`
    if per_group:
        check_group_job(job, cfg.replica_groups)

    def attempt_job(settings: TrainConfig) -> Job | None:
        """The first attempt's job, or a restart's, worked out again: it resumes from the
        newest checkpoint, which has moved on."""
        return job if settings is cfg else job_for(settings, saved_checkpoint(run_dir, report=True))

    weights = initial_weights(cfg.model, cfg.init, model_cfg)  # checks the checkpoint against the model
    # The data too: a missing or short split, a tokenizer larger than the model, bad UTF-8.
    check_corpus(open_training_data(data=cfg.data, tokenizer=cfg.tokenizer, model=cfg.model), model=cfg.model,
                 model_vocab=model_cfg.vocab_size, seq_len=cfg.seq_len, needs_val=cfg.eval_every > 0, doc_mask=cfg.doc_mask)
    if node is not None:  # the other machines may join this launch now
        node.started()
    created = not run_dir.exists()
    # Held until this process exits; the workers inherit it. Across machines, rank 0 takes it.
    if node is None:
        lock = lock_run_dir(run_dir) if nodes[1] == 1 else open(os.devnull)

    params = sum(p.numel() for p in build_model(model_cfg).parameters())  # meta device: no memory
    resumed = job.resume_from if job is not None else (found if cfg.resume else None)
    if resumed is not None:  # the weights come from the run's own checkpoint, not the initialization
        source = f", resuming from its checkpoint of step {resumed.step}"
    else:
        source = f" from {weights.folder}" if weights else f", random initialization from seed {cfg.seed}"
    where = f"{nproc} process{'es' if nproc > 1 else ''}" + (f" per node on {cfg.nnodes} nodes" if nodes[1] > 1 else "")
    if per_group:
        where += f" in {cfg.replica_groups} replica groups of {per_group}"
    if node is not None:
        mine = node.groups
        mine_text = f"group {mine.start}" if len(mine) == 1 else f"groups {mine.start}-{mine.stop - 1}"
        where += f" (node slot {node.rank}: {mine_text}{', joining the running groups' if node.joining else ''})"
    plan = "chosen for the world size found" if job is None else job.plan_text
    print(f"phalanx: training {model_cfg.name} ({params / 1e6:.2f}M parameters{source}) on {where}, "
          f"plan {plan}, run directory {run_dir}", file=sys.stderr)
    restarts = max_restarts(cfg.max_restarts, nproc * nodes[1])
    if per_group:
        def run_group(group: int, first: Job, rejoin: Job) -> int:
            return launch_with_restarts(cfg, per_group, str(run_dir), "", restarts,
                                        lambda settings: first if settings is cfg else rejoin, group=group)
        status = launch_replica_groups(cfg, str(run_dir), attempt_job, run_group, node)
    elif nproc == 1 and nodes[1] == 1 and not restarts:  # in this process: nothing would be left to restart it
        status = worker_main(asdict(cfg), str(run_dir), job=job)
    else:
        status = launch_with_restarts(cfg, nproc, str(run_dir), rdzv_endpoint, restarts, attempt_job)
    status = report_stop(status, run_dir)
    if status and created:
        remove_if_empty(run_dir)
    lock.close()
    if node is not None:
        node.lock.close()
    return status


def _torchrun_worker(cfg: TrainConfig) -> int:
    """This process is one worker of a user's torchrun. A torchrun restart resumes (auto) and
    refuses to retry a user error of an earlier attempt (phalanx/train/restarts.py)."""
    rank0 = os.environ["RANK"] == "0"
    if cfg.max_restarts >= 0 and rank0:
        print("phalanx: warning: --max-restarts is for phalanx's own launcher; under torchrun, "
              "torchrun --max-restarts decides", file=sys.stderr)
    cfg = cfg.replace(resume=resume_mode(cfg.resume))
    # Rank 0 holds the run directory's lock; if it is refused, torchrun stops the other ranks.
    lock = lock_run_dir(Path(cfg.out)) if rank0 else None
    on_user_error = (lambda message: leave_user_error(Path(cfg.out), message)) if rank0 else None
    status = worker_main(asdict(cfg), cfg.out, on_user_error)  # rank 0 works the job out (`--plan auto` too)
    if lock:
        lock.close()
    return report_stop(status, Path(cfg.out)) if rank0 else (0 if status == STOP_STATUS[signal.SIGTERM] else status)


LOCK_FILE = "phalanx.lock"


def lock_run_dir(run_dir: Path, shared: bool = False):
    """Create the run directory if needed and hold an exclusive lock on a file in it, so a
    second run on the same --out is refused instead of interleaving metrics and checkpoints.
    flock's lock goes away with the last process holding the file, so a crash releases it.
    `shared`: a shared lock, as each machine's launcher of a replica-group run holds it (they
    split the directory between them by node slots; any other run is refused)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--out {run_dir} is a file, not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = open(run_dir / LOCK_FILE, "a+")
    except OSError as error:
        raise UserError(f"--out {run_dir}: cannot write a run directory there ({error.strerror})") from None
    try:
        fcntl.flock(lock, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise UserError(f"{run_dir} is in use by another phalanx train ({holder}); wait for it to end, or pass another --out") from None
    if shared:
        return lock
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()}\n")
    lock.flush()
    return lock


def remove_if_empty(run_dir: Path) -> None:
    """Remove a run directory that this launch created when the run wrote no file into it
    but its lock (a worker failed first): no empty run folder is left behind, and no user's
    run is touched."""
    if run_dir.is_dir() and not any(p.is_file() and p.name != LOCK_FILE for p in run_dir.rglob("*")):
        shutil.rmtree(run_dir, ignore_errors=True)


def report_stop(status: int, run_dir: Path) -> int:
    """After a stop by SIGTERM (status 143) or SIGINT (130): say where the run can continue
    from, and how; the exit status is 0 for SIGTERM (a scheduler's preemption, handled), 130
    for Ctrl-C. Other statuses pass through."""
    stopped = {code: sig for sig, code in STOP_STATUS.items()}.get(status)
    if stopped is None:
        return status
    found = latest_checkpoint(run_dir)
    where = f"step {found[0]} in {found[1]}" if found else "none was written yet"
    print(f"phalanx: stopped by {stopped.name}; last checkpoint: {where}; "
          f"continue with: phalanx train --out {run_dir} --resume auto", file=sys.stderr)
    return 0 if stopped == signal.SIGTERM else 130
