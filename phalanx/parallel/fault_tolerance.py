"""Replica groups (`phalanx train --replica-groups R`): torchft's fault tolerance, in one place.

The R groups are data-parallel replicas of one another; each runs the plan's own layout inside
it (its own process group, its own elastic launch) and is a fault domain: a failed worker takes
down only its group. Across groups, torchft (the `ft` extra) does the rest:

- a lighthouse (`start_lighthouse`, in a process of its own that the launcher starts, or one
  given with `--lighthouse`) forms a quorum of the groups present at every step;
- each group's rank r all-reduces its gradients with rank r of the other groups present
  (torchft's reconfigurable gloo or NCCL group, rebuilt when the quorum changes), and the
  step's gradient is averaged over the groups present, as torchft's Manager defines it;
- a group that (re)starts behind the others receives the model and optimizer state of a
  healthy peer at its first quorum (torchft's PGTransport, over that same group: no checkpoint,
  no replay) and takes part from that step on;
- a group whose worker died ends its other workers at once (`broken_group.py`), so that
  neither its restart nor the healthy groups' quorum waits for them;
- the healthy groups keep the gradients of the step a failure broke and run only its
  all-reduce again, at a new quorum (`ReplicaGroupSync.reduce`).

`ReplicaGroupSync` is what the training loop calls, twice a step: `begin_step` (the quorum,
and the live state when this group heals) and `reduce` (after backward: the gradients, the loss
and which groups took part, in one all-reduce, then torchft's commit: every rank of the group
agreed that its all-reduce succeeded). When a group fails during the all-reduce, the others
keep their step's own gradients, take a new quorum without it and run only the all-reduce
again, not the step's forward and backward.

torchft is imported only here and only when replica groups are asked for, so a run without
them needs no torchft.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import multiprocessing
import os
import pickle
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from phalanx.errors import UserError
from phalanx.parallel.broken_group import BrokenGroupWatch
from phalanx.ports import free_port
from phalanx.restart_timeline import mark

GROUP_ENV = "PHALANX_REPLICA_GROUP"
"""Which replica group a worker belongs to (0 .. R-1), set by the launcher of each group."""

LIGHTHOUSE_ENV = "PHALANX_LIGHTHOUSE"
"""The lighthouse's URL, set by the launcher for the workers."""

LAUNCH_ENV = "PHALANX_REPLICA_LAUNCH"
"""An id of one launch of all groups, for their first meeting (`wait_for_groups`)."""

DIGEST_ENV = "PHALANX_TEST_STATE_DIGESTS"
"""Test hook: when set, rank 0 of each group appends, after each step it commits, a digest of its
model's and optimizer's state to `state_digests.jsonl` in the run directory, so a test can check
that groups hold bit-equal state (a rejoined group from its first step on)."""

HEARTBEAT_INTERVAL_MS = 50
"""How often each group's torchft manager heartbeats to the lighthouse, from a thread of its own
(torchft's default: 100 ms). Half of it halves the timeout below for the same count of missed
heartbeats: a dead group is dropped sooner."""

HEARTBEAT_TIMEOUT_MS = 300
"""How long the lighthouse keeps counting a group whose heartbeats stopped. When a group dies,
the others' new quorum waits this long after its last heartbeat (`broken_group.py` stops the
group's heartbeats within 0.05 to 0.15 s of the kill), unless the group is back first: a
restarted group's manager registers under a new id (torchft adds a uuid to each incarnation's),
so the lighthouse waits for its dead predecessor's heartbeats to expire even once the restarted
group asks (`goodput.py --timeline`: its quorum request at 0.31-0.45 s after the kill, the quorum
at 0.57-0.71 s with the timeout at 500 ms). The largest heartbeat age of a live group that the
lighthouse's status page showed (benchmarks/goodput.py --heartbeats, benchmarks/README.md) was
69 ms with heartbeats every 50 ms (load average 2 to 5 on the 2 shared cores, 8,114 polls) and
73 ms with six busy processes beside the benchmark's four (load average 8, 14,847 polls), and
106-112 ms with heartbeats every 100 ms (up to load average 8 to 9): 300 ms is 4.1 times the
largest, 5 heartbeats missed in a row (500 ms was 4.5 times the 100 ms heartbeats' 112 ms). A live group later than
that and not yet at the quorum would sit out one step and then receive a peer's state (a heal,
not a failure). It was 2 s (set when a first test with 1 s dropped a live group, before the
forkservers and the broken-group watch), then 500 ms (branch ft2)."""

JOIN_TIMEOUT_MS = 1000
"""How long the lighthouse waits for a heartbeating group to ask for the quorum before it forms
one without it (a group that restarts is heartbeating from just before its first quorum)."""

QUORUM_TICK_MS = 20
"""How often the lighthouse checks whether a quorum can form (its default is 100 ms: a tenth
of a small model's step on CPU, paid at every step)."""


def require_torchft() -> None:
    # torchft's Rust side logs every quorum at INFO unless RUST_LOG says otherwise, read when
    # torchft is first imported (forked workers inherit that).
    os.environ.setdefault("RUST_LOG", "error")
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise UserError("--replica-groups needs torchft: pip install 'phalanx[ft]'") from None


def check_replica_groups(groups: int, world: int, nodes: int = 1) -> int:
    """Processes per group; the groups must split the processes evenly. With `nodes` machines
    (--nnodes), each runs groups / nodes whole groups on its `world` processes (--nproc)."""
    if nodes > 1:
        if groups % nodes:
            raise UserError(f"--replica-groups {groups} must divide evenly over the {nodes} nodes of --nnodes "
                            "(each node runs whole groups)")
        if world % (groups // nodes):
            raise UserError(f"--replica-groups {groups} over {nodes} nodes is {groups // nodes} groups per node, "
                            f"which must divide the {world} processes per node (--nproc) evenly")
        return world // (groups // nodes)
    if groups < 1 or world % groups:
        raise UserError(f"--replica-groups {groups} must divide the {world} processes (--nproc) evenly")
    return world // groups


def lighthouse_url(address: str) -> str:
    """torchft's form of a lighthouse address, from HOST:PORT (or a URL already)."""
    return address if "://" in address else f"http://{address}"


def check_lighthouse(address: str, timeout_s: float = 3.0) -> str:
    """A lighthouse given with --lighthouse HOST:PORT, checked reachable (one line if not)."""
    host, sep, port = address.rpartition("://")[2].rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UserError(f"--lighthouse {address!r} must be HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise UserError(f"--lighthouse {address}: cannot reach a lighthouse there ({error.strerror or error})") from None
    return lighthouse_url(address)


def _serve_lighthouse(port: int, ready) -> None:
    """Body of the lighthouse process: torchft's server (threads of its own) until terminated."""
    require_torchft()
    # Imported when asked for, not at the top: torchft is the optional `ft` extra, needed only with --replica-groups.
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{port}", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                              quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    ready.send(port)
    ready.close()
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()


def start_lighthouse():
    """A lighthouse in a process of its own (so that the launcher, which forks the groups'
    launchers, holds no server threads of torchft at a fork); returns (process, its URL)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    port = free_port()
    process = context.Process(target=_serve_lighthouse, args=(port, send), daemon=True, name="phalanx-lighthouse")
    process.start()
    send.close()
    if not receive.poll(30) or receive.recv() != port:
        process.kill()
        raise RuntimeError("torchft's lighthouse did not start")
    return process, f"http://127.0.0.1:{port}"


def wait_for_groups(run_dir: Path, launch_id: str, group: int, groups: int, timeout_s: float) -> None:
    """A first launch's groups meet here, each with its torchft manager up (heartbeating), before
    the first quorum: a lighthouse forms a quorum of the groups it has heard of, so a group that
    started a little late would otherwise miss step 1 and join it only by healing. One file per
    group in the run directory (every node sees it); `launch_id` keeps launches apart; `groups`:
    how many groups to wait for (with --nnodes MIN:MAX, those of MIN machines)."""
    folder = run_dir / ".replica_groups"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{launch_id}.{group}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(folder.glob(f"{launch_id}.*"))) < groups:
        if time.monotonic() > deadline:
            raise RuntimeError(f"replica group {group}: the other groups did not start within {timeout_s:.0f} s")
        time.sleep(0.02)


@dataclass(frozen=True)
class StepReduction:
    """What a step's cross-group all-reduce gave."""

    loss_sum: torch.Tensor
    """This rank's share of the loss, averaged over the groups present (as gradients are)."""
    groups: list[int]
    """The groups that took part in this step, in order."""
    healed: list[int]
    """The groups among them that received their state from a peer at this step's quorum."""
    retry_s: float = 0.0
    """Seconds this rank spent on all-reduces that a failed group broke and on the new quorums
    after them (from the first all-reduce's start to the end of the one that went through):
    not the step's work, so not in its `step_time_s`."""


class ReplicaGroupSync:
    """torchft's Manager for one rank of one replica group (see the module docstring).

    `model`, `optimizer`: what a healing group receives; `rank`, `world`: this rank's place in
    its group (rank 0 serves the group's torchft manager, whose address it leaves in the
    elastic agent's store at MASTER_ADDR:MASTER_PORT); `step`: the step this group starts from
    (a checkpoint's, or 0); `steps`: the run's last step; `store_host`: the address of that
    store that the other groups are told (they rendezvous there when this group leads a quorum):
    MASTER_ADDR when empty, which a group launched on one machine has as 127.0.0.1."""

    def __init__(self, *, group: int, groups: int, lighthouse: str, model, optimizer, device: torch.device,
                 rank: int, world: int, step: int, timeout_s: float, steps: int, store_host: str = ""):
        require_torchft()
        # Imported when asked for, not at the top: torchft is the optional `ft` extra, needed only with --replica-groups.
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport

        # PGTransport's frombuffer of a pickle, and its use of a deprecated pytree name: torchft's own
        # business, printed once per healing process.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        warnings.filterwarnings("ignore", category=FutureWarning, module="torchft")
        # A warning per quorum about NCCL's flight recorder, and, when a group dies, a traceback per
        # surviving rank of the all-reduce that lost it: expected, the all-reduce runs again, and
        # the launcher's line and the metrics' event rows say which group left.
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        self.group, self.groups, self.device, self.steps = group, groups, device, steps
        self.model, self.optimizer = model, optimizer
        self.healed_now = False
        self.retrying = False
        """Whether this rank is in a step's all-reduce again (`reduce`): said to a group that
        heals from it meanwhile, which then sits that step out (`sitting_out`)."""
        self.sitting_out = False
        """This group received its state from a peer that is in the middle of the step (its
        all-reduce broken by a failed group, the step's gradients computed): it takes no part
        in that step (zero gradients, not counted among the groups present) and applies the
        others' averaged gradients, as torchft's asynchronous quorum lets a healing group sit
        out its first step. Computing its own share instead, it would hold the peers in their
        all-reduce for its forward and backward (0.45-0.55 s a kill on the loaded 2-core machine,
        measured: `goodput.py --timeline`), none of which counts as step time."""
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = _replica_process_group(device, timeout)
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=1,
            # The quorum before the step, healing included: a group that receives the state takes
            # part in the same step (an asynchronous quorum would let it sit that step out).
            use_async_quorum=False,
            # Every group draws the same initial weights from the seed (or loads the same checkpoint):
            # nothing to send at step 0.
            init_sync=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=rank, world_size=world, store_addr=store_host or os.environ["MASTER_ADDR"],
            store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=lighthouse, replica_id=f"phalanx_group_{group}", hostname=socket.gethostname(),
            heartbeat_interval=datetime.timedelta(milliseconds=HEARTBEAT_INTERVAL_MS),
            checkpoint_transport=(PGTransport(self.pg, timeout=timeout, device=device) if device.type == "cuda"
                                  else FlatStateTransport(self.pg)),
        )
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        # A dead sibling ends this worker's step, and at once its manager's heartbeats (rank 0's),
        # which would keep the lighthouse counting this group.
        self.watch = BrokenGroupWatch(_sibling_pids(world), on_broken=lambda: self.manager.shutdown(wait=False))

    def _state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "mid_step": self.retrying}

    def _load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.healed_now = True
        self.sitting_out = bool(state.get("mid_step"))

    def begin_step(self) -> int:
        """The step's quorum (a healing group receives the live state here); the step to run.
        From here to the step's commit every process of the group takes part: a sibling that
        exits meanwhile has broken the group (`broken_group.py`)."""
        self.healed_now = self.sitting_out = False
        self.watch.enter()
        mark("quorum_ask")
        self.manager.start_quorum()
        step = self.manager.current_step()
        mark("quorum_done", f"{step} healed={int(self.healed_now)}")
        if step >= self.steps:  # the run is over: siblings now leave as they finish
            self.watch.leave()
        return step

    def set_step(self, step: int) -> None:
        """The step this group is at, after it loaded a checkpoint itself."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def reduce(self, params, loss_sum: torch.Tensor) -> StepReduction | None:
        """After backward (and the group's own gradient reduction): sum this rank's gradients,
        loss share and a flag of its group (and whether it healed) with the same rank of every
        group present, in one all-reduce, and divide by the groups present, once torchft's
        commit says every rank of the group got through its all-reduce (collective within the
        group). None: the step must run again from its forward (this group received a peer's
        state at a new quorum meanwhile). A group `sitting_out` its step adds zero gradients and
        loss, and is not counted among the groups present.

        A group that dies during the step breaks the all-reduce of the others. Their own
        gradients are still the step's (written back only after a commit), so they take a new
        quorum, which goes on without the dead group once the lighthouse stops counting it (or
        with it restarted, healing from them: it then sits the step out, `sitting_out`), and run
        the all-reduce again: a failure costs the survivors no forward and backward of their own."""
        if self.sitting_out:  # every parameter takes the others' averaged gradient
            for param in params:
                param.grad = torch.zeros_like(param)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        step, began, retried = self.manager.current_step(), time.perf_counter(), False
        while True:
            flags = torch.zeros(2 * self.groups, dtype=torch.float32, device=self.device)
            flags[self.group] = float(not self.sitting_out)
            flags[self.groups + self.group] = float(self.healed_now)
            flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss_sum.detach().reshape(1).float(), flags])
            self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
            if self.manager.should_commit():
                break
            retried = self.retrying = True
            mark("allreduce_broken")
            try:
                self.manager.start_quorum()  # a group healing from this rank here learns it is mid-step
            finally:
                self.retrying = False
            mark("quorum_again", str(self.manager.current_step()))
            if self.healed_now or self.manager.current_step() != step:
                self.watch.leave()  # the step's next quorum enters it again
                return None
        self.watch.leave()
        offset = sum(grad.numel() for grad in grads)
        flags = flat[offset + 1:].tolist()
        groups = [g for g in range(self.groups) if flags[g] > 0.5]
        present = max(len(groups), 1)  # torchft's participants, less a group sitting the step out
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad) / present)
            offset += grad.numel()
        return StepReduction(loss_sum=flat[offset] / present, groups=groups,
                             healed=[g for g in range(self.groups) if flags[self.groups + g] > 0.5],
                             retry_s=time.perf_counter() - began if retried else 0.0)

    def shutdown(self) -> None:
        self.watch.stop()
        self.manager.shutdown(wait=False)


class FlatStateTransport:
    """torchft's checkpoint transport (its `CheckpointTransport` methods) for a healing group on
    CPU: the peer's whole state in one buffer, three messages over the replica groups' gloo
    group (sizes, the tree and tensor layout pickled, the bytes), where torchft's `PGTransport`
    sends and waits for each tensor in turn. A small model's state on CPU is some 200 tensors
    (weights and two Adam moments each), and that way each one was a round trip through gloo's
    threads: measured 0.3 to 0.5 s a heal on the loaded 2-core machine, the surviving groups
    blocked as long (they send at their quorum). On GPUs `PGTransport` stays: NCCL's sends are
    queued on a stream, and one buffer would double the state's device memory. Bytes are
    copied as they are, so the healed group's state equals its peer's bit for bit."""

    ALIGN = 64
    """Each tensor's bytes start at a multiple of this in the buffer, so the receiver's views
    of them are aligned for any dtype."""

    def __init__(self, pg) -> None:
        self.pg = pg

    def metadata(self) -> str:
        return "<n/a>"

    def disallow_checkpoint(self) -> None:
        pass

    def shutdown(self, wait: bool = True) -> None:
        pass

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict, timeout: datetime.timedelta) -> None:
        tensors: list = []
        tree = _without_tensors(state_dict, tensors)
        layout, offset = [], 0
        for index, leaf in enumerate(tensors):
            tensor = (leaf.to_local() if isinstance(leaf, DTensor) else leaf).detach().contiguous()
            mesh = (leaf.device_mesh, leaf.placements, leaf.shape, leaf.stride()) if isinstance(leaf, DTensor) else None
            layout.append((offset, tensor.dtype, tuple(tensor.shape), mesh))
            tensors[index] = tensor
            offset += -(-tensor.numel() * tensor.element_size() // self.ALIGN) * self.ALIGN
        flat = torch.empty(offset, dtype=torch.uint8)
        for (start, *_), tensor in zip(layout, tensors):
            flat[start:start + tensor.numel() * tensor.element_size()].copy_(tensor.reshape(-1).view(torch.uint8))
        meta = torch.frombuffer(bytearray(pickle.dumps((step, tree, layout))), dtype=torch.uint8)
        sizes = torch.tensor([meta.numel(), flat.numel()], dtype=torch.int64)
        works = [work for rank in dst_ranks
                 for work in (self.pg.send([sizes], rank, tag=1), self.pg.send([meta], rank, tag=2),
                              self.pg.send([flat], rank, tag=3))]
        for work in works:
            work.wait(timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: datetime.timedelta):
        sizes = torch.zeros(2, dtype=torch.int64)
        self.pg.recv([sizes], src_rank, tag=1).wait(timeout)
        meta, flat = torch.empty(int(sizes[0]), dtype=torch.uint8), torch.empty(int(sizes[1]), dtype=torch.uint8)
        self.pg.recv([meta], src_rank, tag=2).wait(timeout)
        self.pg.recv([flat], src_rank, tag=3).wait(timeout)
        sent_step, tree, layout = pickle.loads(meta.numpy().tobytes())
        if sent_step != step:
            raise RuntimeError(f"a peer sent its state of step {sent_step}, expected step {step}")
        tensors = []
        for start, dtype, shape, mesh in layout:
            count = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            tensor = flat[start:start + count].view(dtype).view(shape)
            if mesh is not None:
                tensor = DTensor.from_local(tensor, mesh[0], mesh[1], run_check=False, shape=mesh[2], stride=mesh[3])
            tensors.append(tensor)
        return _with_tensors(tree, tensors)


@dataclass(frozen=True)
class _Slot:
    """Where a state dict's tensor was, in `FlatStateTransport`'s pickled tree."""

    index: int


def _without_tensors(tree, tensors: list):
    """`tree` (dicts, lists, tuples) with each tensor moved to `tensors` and a `_Slot` in its place."""
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return _Slot(len(tensors) - 1)
    if isinstance(tree, dict):
        return {key: _without_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_without_tensors(value, tensors) for value in tree)
    return tree


def _with_tensors(tree, tensors: list):
    """`_without_tensors`'s inverse."""
    if isinstance(tree, _Slot):
        return tensors[tree.index]
    if isinstance(tree, dict):
        return {key: _with_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_with_tensors(value, tensors) for value in tree)
    return tree


def _sibling_pids(world: int) -> list[int]:
    """The process ids of this group's other workers (one all-gather in the group)."""
    if world == 1 or not torch.distributed.is_initialized():
        return []
    pids: list[int] = [0] * world
    torch.distributed.all_gather_object(pids, os.getpid())
    return [pid for pid in pids if pid != os.getpid()]


def replica_group(cfg, model, optimizer, device: torch.device, *, rank: int, world: int, step: int,
                  run_dir: Path, first_attempt: bool) -> ReplicaGroupSync | None:
    """This rank's torchft manager when the run has replica groups (else None), joined up: on
    a group's first attempt, once every group's manager is up (`wait_for_groups`); a restarted
    group goes straight to its quorum, where it heals."""
    if cfg.replica_groups == 1:
        return None
    low, high = cfg.node_range
    # Across machines (--nnodes), the other groups reach this group's store by this machine's
    # name, as they reach its torchft manager (torchft advertises that at socket.gethostname());
    # the elastic agent's store listens on every interface.
    sync = ReplicaGroupSync(group=int(os.environ[GROUP_ENV]), groups=cfg.replica_groups,
                            lighthouse=os.environ[LIGHTHOUSE_ENV], model=model, optimizer=optimizer, device=device,
                            rank=rank, world=world, step=step, timeout_s=cfg.collective_timeout, steps=cfg.steps,
                            store_host=socket.gethostname() if high > 1 else "")
    if first_attempt and rank == 0:  # the group's other ranks wait for it at the first quorum
        # With --nnodes MIN:MAX the first step waits for the groups of MIN nodes (all of them
        # with a fixed --nnodes N); the groups of nodes that start later heal into the run.
        wait_for_groups(run_dir, os.environ[LAUNCH_ENV], sync.group, sync.groups // high * low, cfg.collective_timeout)
    return sync


def state_digest(run_dir: Path, group: int, step: int, model, optimizer) -> None:
    """A digest of `group`'s weights and optimizer state after `step`, appended to the run's
    state_digests.jsonl: the test probe DIGEST_ENV turns on (injected_faults.py reads it once)."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(_bytes(value))
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            digest.update(f"{index}.{key}".encode())
            digest.update(_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode())
    with (run_dir / "state_digests.jsonl").open("a") as file:
        file.write(json.dumps({"step": step, "group": group, "digest": digest.hexdigest()}) + "\n")


def _bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # rank 0's shard: no collective
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _replica_process_group(device: torch.device, timeout: datetime.timedelta):
    """torchft's reconfigurable group across the replicas: gloo on CPU, NCCL on GPU."""
    # Imported when asked for, not at the top: torchft is the optional `ft` extra, needed only with --replica-groups.
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    return ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)


def writer_group(reduction: StepReduction) -> int | None:
    """The group whose rank 0 writes the step's metrics row and checkpoint: the first group
    present that did not just heal (it knows which groups took part in the step before)."""
    steady = [g for g in reduction.groups if g not in reduction.healed]
    return steady[0] if steady else None


def membership_events(step: int, before: list[int] | None, now: StepReduction) -> list[dict]:
    """metrics.jsonl event rows for the groups that left or came back between two steps: a
    group missing from `now`'s step that took part in the one `before` is lost; one back is
    rejoined. A group that restarted so fast that it missed no step (its new workers were at
    the quorum before the lighthouse dropped the old ones) took part in both steps but received
    its state at this one (`now.healed`): it was lost and rejoined at this step."""
    if before is None:
        return []
    lost = [g for g in before if g not in now.groups or g in now.healed]
    back = [g for g in now.groups if g not in before or g in now.healed]
    return ([{"event": "group_lost", "step": step, "group": g} for g in lost]
            + [{"event": "group_rejoined", "step": step, "group": g} for g in back])
