"""Launching `phalanx train --replica-groups R`: R groups of nproc / R workers, each with a
launcher of its own, so that a failed worker stops and restarts only its group.

This process starts torchft's lighthouse (unless `--lighthouse` names one), then forks one
launcher per group. Each runs, for its own workers and with `PHALANX_REPLICA_GROUP` set, the
one launcher and restart policy of every command (phalanx/launch/worker_launch.py,
phalanx/launch/restart_policy.py: one elastic launch per attempt, the same lines, here prefixed with
the group), as `phalanx train`'s `launch_with_restarts` calls them;
the workers meet the other groups through the lighthouse (`parallel/fault_tolerance.py`). A
restarted group receives at its first quorum the live state of a group that is ahead; only
when none is (every group failed, or the others finished) does it load the newest checkpoint.

The groups share the run directory: metrics.jsonl is prepared here once and each step's row is
appended by one group (`fault_tolerance.writer_group`), as are the checkpoints.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import uuid
from pathlib import Path

from phalanx.errors import UserError
from phalanx.model.by_name import model_config
from phalanx.parallel.fault_tolerance import (
    GROUP_ENV, LAUNCH_ENV, LIGHTHOUSE_ENV, check_lighthouse, check_replica_groups, require_torchft, start_lighthouse,
)
from phalanx.train.config import TrainConfig
from phalanx.train.metrics import prepare_metrics


def group_processes(cfg: TrainConfig, nproc: int) -> int:
    """Checks `--replica-groups` before anything starts; the processes of each group."""
    require_torchft()
    if cfg.node_range[1] > 1:
        raise UserError("--replica-groups with --nnodes is not supported yet: run one launcher per group, "
                        "each with --lighthouse HOST:PORT (docs/fault_tolerance.md)")
    per_group = check_replica_groups(cfg.replica_groups, nproc)
    if cfg.lighthouse:
        check_lighthouse(cfg.lighthouse)
    return per_group


def check_group_job(job, groups: int) -> None:
    """What a replica group cannot run (yet), and why, in one line."""
    settings, plan = job.settings, job.plan
    if settings.global_batch % (groups * plan.dp):
        raise UserError(f"--global-batch {settings.global_batch} must divide evenly over {groups} replica groups "
                        f"x dp={plan.dp} = {groups * plan.dp} data-parallel ranks")
    if job.expert_slots or plan.ep > 1 or _is_moe(settings.model):
        raise UserError("--replica-groups does not support MoE models yet: each group's routers would follow "
                        "their own expert loads and drift apart")


def _is_moe(model: str) -> bool:
    return bool(getattr(model_config(model), "n_experts", 0))


def launch_replica_groups(cfg: TrainConfig, run_dir: str, job_for, run_group) -> int:
    """Run the R groups to the end; the run's exit status. `job_for(cfg)`: a group's job (its
    world is one group's processes); `run_group(group, first, rejoin)`: a group's launcher,
    under the restart policy, its first attempt running the job `first` and each restart
    `rejoin`; its exit status."""
    # Imported when run, not at the top: TensorBoard's writer, which a group's rank 0 opens before its first quorum
    # (train/metrics.py). Imported in this process, it is in every group's launcher and forkserver (forks of it), and
    # a restarted group does not wait for the import: 0.4-0.5 s of its 1 to 1.5 s from a kill to its quorum on the
    # loaded 2-core machine, measured, while the other groups stepped without it.
    import torch.utils.tensorboard  # noqa: F401

    first = job_for(cfg)
    # A restarted group rejoins from a peer's live state, with no checkpoint read (one a peer may
    # be pruning); only if no group is ahead at its first quorum does it load one (loop.py).
    rejoin = dataclasses.replace(first, resume_from=None)
    prepare_metrics(Path(run_dir) / "metrics.jsonl", first.start_step if first and first.resume_from else None)
    lighthouse = None
    url = check_lighthouse(cfg.lighthouse) if cfg.lighthouse else None
    if url is None:
        lighthouse, url = start_lighthouse()
        # Its status page (/status) shows the quorum and each group's last heartbeat.
        print(f"phalanx: torchft lighthouse at {url}", file=sys.stderr, flush=True)
    saved = {name: os.environ.get(name) for name in (LAUNCH_ENV, LIGHTHOUSE_ENV, GROUP_ENV)}
    os.environ[LAUNCH_ENV], os.environ[LIGHTHOUSE_ENV] = uuid.uuid4().hex[:12], url

    def group_launcher(group: int) -> None:
        os.environ[GROUP_ENV] = str(group)
        status = run_group(group, first, rejoin)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # a forked launcher: no atexit handlers of the parent's

    context = multiprocessing.get_context("fork")
    launchers = [context.Process(target=group_launcher, args=(g,), name=f"phalanx-group-{g}") for g in range(cfg.replica_groups)]
    forward = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for launcher in launchers:
            launcher.start()

        def pass_on(signum, frame):  # each group's agent stops its workers after a checkpoint
            for launcher in launchers:
                if launcher.pid and launcher.exitcode is None:
                    os.kill(launcher.pid, signum)
        for sig in forward:
            signal.signal(sig, pass_on)
        for launcher in launchers:
            launcher.join()
    finally:
        for sig, handler in forward.items():
            signal.signal(sig, handler)
        for launcher in launchers:
            if launcher.exitcode is None and launcher.pid:
                launcher.kill()
        if lighthouse is not None:
            lighthouse.kill()
            lighthouse.join()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return run_status([launcher.exitcode for launcher in launchers])


def run_status(codes: list[int]) -> int:
    """The run's exit status from its groups': 0 when all succeeded; 2 when a user error stopped
    them; a stop by signal (130, 143) when that stopped them; else 1 (a group's restarts ran out)."""
    if all(code == 0 for code in codes):
        return 0
    for wanted in (2, 143, 130):
        if wanted in codes and all(code in (0, wanted) for code in codes):
            return wanted
    return 1
