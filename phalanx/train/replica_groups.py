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

Several machines (`--nnodes N` or `MIN:MAX`, the same command on each): every machine runs
whole groups, R / MAX of them, and the groups of all machines meet at one lighthouse that
outlives any of them (`--lighthouse HOST:PORT`, required then) and in one run directory that
every machine sees (`--out`, as any --nnodes run's). A machine's launcher takes the lowest free
node slot of the run directory (`claim_node`: a lock file per slot, released when the
launcher's processes are gone) and runs the groups of that slot, numbered across machines
(slot x groups per node + local index). So a machine that is lost takes its groups with it
while the others step on, and the same command started again (on it or on another machine)
takes the slot that was freed and its groups rejoin from a peer's live state, as a restarted
group does. With MIN:MAX the first step waits for MIN machines' groups; a machine that starts
later joins the same way. No collective spans machines except torchft's, so the workers of
each group are one local launch, and no --rdzv-endpoint is needed.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import multiprocessing
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO

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
    nodes = cfg.node_range[1]
    per_group = check_replica_groups(cfg.replica_groups, nproc, nodes)
    if nodes > 1 and not cfg.lighthouse:
        # One started by a launcher would die with its machine, and every group with it.
        raise UserError(f"--replica-groups with --nnodes {cfg.nnodes} needs --lighthouse HOST:PORT, a torchft "
                        "lighthouse that every machine reaches and that outlives each of them (docs/fault_tolerance.md)")
    if nodes > 1 and not cfg.out:
        raise UserError(f"--replica-groups with --nnodes {cfg.nnodes} needs --out DIR on a file system every machine "
                        "sees (the groups of all machines meet and write there)")
    if cfg.lighthouse:
        check_lighthouse(cfg.lighthouse)
    return per_group


NODES_FOLDER = ".replica_groups"
"""In the run directory: the node slots' lock files, the launch record, the first meeting's files."""


@dataclass
class NodeSlot:
    """The node slot this machine's launcher holds (`claim_node`)."""

    rank: int
    """The slot: this machine runs groups rank x per_node .. rank x per_node + per_node - 1."""
    per_node: int
    launch_id: str
    """The launch of all machines' groups, for their first meeting (`wait_for_groups`)."""
    joining: bool
    """Another machine started this launch: this one's groups heal from their peers' state at
    their first quorum (no checkpoint read), and the run directory is the starter's to check
    and prepare."""
    lock: IO
    """The slot's lock file, held (with its lock) while this launcher and its processes live."""
    record: dict
    turn: IO | None = None
    """The starter's: the claiming lock, held until `started` (see `claim_node`)."""

    @property
    def groups(self) -> range:
        return range(self.rank * self.per_node, (self.rank + 1) * self.per_node)

    def started(self) -> None:
        """The starter's checks passed (the run directory, the checkpoint, the job): the other
        machines may join now."""
        if self.turn is not None:
            (self.lock_folder / "launch.json").write_text(json.dumps(self.record))
            self.turn.close()
            self.turn = None

    @property
    def lock_folder(self) -> Path:
        return Path(self.lock.name).parent


def claim_node(run_dir: Path, cfg: TrainConfig, nproc: int) -> NodeSlot:
    """The lowest free node slot of the run directory, taken for this launcher: one lock file
    per slot (0 .. MAX-1 of --nnodes), flock'ed while this launcher and its processes live, so
    the slot of a machine that is gone is free again. One machine claims at a time (a lock
    around it). The first machine of a launch (no other slot held) keeps that lock until its
    checks passed (`NodeSlot.started`): a machine that claims meanwhile waits, and then joins
    its launch, or, if the first one gave up (its one-line error), is the first itself and
    makes the same checks. One that joins checks that it runs the same command."""
    folder = run_dir / NODES_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    slots = cfg.node_range[1]
    settings = {"replica_groups": cfg.replica_groups, "nnodes": cfg.nnodes, "nproc": nproc}
    turn = open(folder / "nodes.lock", "a+")
    fcntl.flock(turn, fcntl.LOCK_EX)
    mine, held = None, 0
    for slot in range(slots):
        lock = open(folder / f"node.{slot}.lock", "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held += 1
            lock.close()
            continue
        if mine is None:
            mine = (slot, lock)
        else:
            lock.close()  # free, only looked at
    if mine is None:
        turn.close()
        raise UserError(f"{run_dir}: all {slots} node slots are taken: --nnodes {cfg.nnodes} machines run it already")
    per_node = cfg.replica_groups // slots
    if not held:  # the first machine of a launch: the others wait for its checks
        record = {"launch": uuid.uuid4().hex[:12], **settings}
        return NodeSlot(rank=mine[0], per_node=per_node, launch_id=record["launch"], joining=False, lock=mine[1],
                        record=record, turn=turn)
    turn.close()
    record = json.loads((folder / "launch.json").read_text())
    differ = [f"--{key.replace('_', '-')} {record[key]}" for key in settings if record[key] != settings[key]]
    if differ:
        mine[1].close()
        raise UserError(f"{run_dir} is being trained with {', '.join(differ)} on the other nodes; "
                        "run the same command on every machine")
    return NodeSlot(rank=mine[0], per_node=per_node, launch_id=record["launch"], joining=True, lock=mine[1], record=record)


def check_group_job(job, groups: int) -> None:
    """What a replica group cannot run (yet), and why, in one line (a batch that does not divide
    over the groups' ranks and micro-batches: plan_model_checks.validate_for_model)."""
    settings, plan = job.settings, job.plan
    if job.expert_slots or plan.ep > 1 or _is_moe(settings.model):
        raise UserError("--replica-groups does not support MoE models yet: each group's routers would follow "
                        "their own expert loads and drift apart")


def _is_moe(model: str) -> bool:
    return bool(getattr(model_config(model), "n_experts", 0))


def launch_replica_groups(cfg: TrainConfig, run_dir: str, job_for, run_group, node: NodeSlot | None = None) -> int:
    """Run the R groups to the end (with `node`, this machine's slot under --nnodes: its
    groups); the exit status. `job_for(cfg)`: a group's job (its world is one group's
    processes); `run_group(group, first, rejoin)`: a group's launcher, under the restart
    policy, its first attempt running the job `first` and each restart `rejoin`; its exit status."""
    # Imported when run, not at the top: TensorBoard's writer, which a group's rank 0 opens before its first quorum
    # (train/metrics.py). Imported in this process, it is in every group's launcher and forkserver (forks of it), and
    # a restarted group does not wait for the import: 0.4-0.5 s of its 1 to 1.5 s from a kill to its quorum on the
    # loaded 2-core machine, measured, while the other groups stepped without it.
    import torch.utils.tensorboard  # noqa: F401

    first = job_for(cfg)
    # A restarted group rejoins from a peer's live state, with no checkpoint read (one a peer may
    # be pruning); only if no group is ahead at its first quorum does it load one (loop.py).
    rejoin = dataclasses.replace(first, resume_from=None)
    if node is None or not node.joining:  # a machine that joins a running launch leaves the file to it
        prepare_metrics(Path(run_dir) / "metrics.jsonl", first.start_step if first and first.resume_from else None)
    if node is not None and node.joining:  # its groups heal from their peers at their first quorum
        first = rejoin
    lighthouse = None
    url = check_lighthouse(cfg.lighthouse) if cfg.lighthouse else None
    if url is None:
        lighthouse, url = start_lighthouse()
        # Its status page (/status) shows the quorum and each group's last heartbeat.
        print(f"phalanx: torchft lighthouse at {url}", file=sys.stderr, flush=True)
    saved = {name: os.environ.get(name) for name in (LAUNCH_ENV, LIGHTHOUSE_ENV, GROUP_ENV)}
    os.environ[LAUNCH_ENV], os.environ[LIGHTHOUSE_ENV] = node.launch_id if node else uuid.uuid4().hex[:12], url

    def group_launcher(group: int) -> None:
        os.environ[GROUP_ENV] = str(group)
        status = run_group(group, first, rejoin)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # a forked launcher: no atexit handlers of the parent's

    context = multiprocessing.get_context("fork")
    launchers = [context.Process(target=group_launcher, args=(g,), name=f"phalanx-group-{g}")
                 for g in (node.groups if node else range(cfg.replica_groups))]
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
