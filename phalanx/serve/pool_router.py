"""Per-class pools (`phalanx serve --pool latency:tp=2 --pool throughput:tp=1`): which pool a
request belongs to, which of the pool's engines takes it, and when ranks should move from an
idle pool to one that queues: plain data and logic, driven by tests on a simulated clock.

A pool is one or more engine instances, each a `phalanx serve` over its own ranks in the
pool's layout (`pool_server.py` starts them). A request's class is its `X-Phalanx-Class`
header (a pool's name), else OpenAI's `service_tier` (`priority` -> latency; `auto`,
`default`, `flex` -> throughput), else the throughput pool (or the first one named).

A pool queues past its target, under `--ttft-ms`, when a request of it has waited longer than
the TTFT target without a seat (`oldest_wait`), or one of its instances refused a request at
arrival for that target (429 `ttft_target_unattainable`: the SLO scheduler refuses rather than
queue) within the last TTFT target; without `--ttft-ms`, when it holds more requests than its
seats (instances x `--max-num-seqs`). It idles when it holds none. When one has idled and the other queued for
`move_after_s`, ranks move (`plan_move`): the idle pool gives its newest instance if it has
several, else re-shards its one instance to half its tensor-parallel ranks (drain, re-shard,
resume); the queued pool takes the ranks as a new instance of its layout (it keeps serving
meanwhile), or, if it was itself shrunk before, re-shards back up to its layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from phalanx.errors import UserError
from phalanx.plan import plan_from_string

SERVICE_TIERS = {"priority": "latency", "auto": "throughput", "default": "throughput", "flex": "throughput"}
"""OpenAI's service_tier values (api_requests.SERVICE_TIERS) and the class each one means."""
NAME = re.compile(r"[a-z][a-z0-9_-]*")


class UnknownClass(ValueError):
    """A request named a class no pool serves (the API answers 400)."""


@dataclass(frozen=True)
class PoolSpec:
    name: str
    plan: str
    """Its layout, as `--plan` spells it (e.g. tp=2)."""
    world: int
    """Ranks of one instance of the layout."""
    instances: int = 1
    """Instances it starts with (`--pool auto` may start several; a named pool starts one)."""


def tp_plan(ranks: int) -> str:
    return f"tp={ranks}"


def parse_pools(values: list[str], check_plan=None) -> list[PoolSpec]:
    """`--pool NAME:PLAN` flags as specs; `check_plan(plan, world)` refuses a layout that
    `phalanx serve` does not run (a UserError)."""
    if "auto" in values:  # pool_auto.py plans it from the flags; here only the named pools' grammar
        raise UserError("--pool auto is the planner's whole split: give it alone (with --nproc N and "
                        "--ttft-ms/--tpot-ms), not beside named pools")
    specs: list[PoolSpec] = []
    for value in values:
        name, sep, plan_text = value.partition(":")
        if not sep or not NAME.fullmatch(name) or not plan_text:
            raise UserError(f"--pool {value!r}: expected NAME:PLAN, e.g. latency:tp=2 (a lower-case name, then a "
                            "layout as --plan spells it)")
        if any(spec.name == name for spec in specs):
            raise UserError(f"--pool {name} is given twice")
        plan = plan_from_string(plan_text)
        if check_plan is not None:
            check_plan(plan_text, plan.world_size)
        specs.append(PoolSpec(name, plan_text, plan.world_size))
    return specs


@dataclass(eq=False)
class Instance:
    plan: str
    ranks: tuple[int, ...]
    ident: int
    """Unique over the server's life (the `instance` label of its metrics)."""
    ready: bool = False
    """Started and healthy: requests may be sent to it."""
    draining: bool = False
    """Being emptied for a move: no new requests."""
    arrivals: list[float] = field(default_factory=list)
    """When each request in flight on it arrived at the front (the router's clock), oldest first."""
    address: tuple[str, int] | None = None
    failed: str | None = None
    """Why its process died, while the front restarts it (pool_server.py)."""

    @property
    def in_flight(self) -> int:
        return len(self.arrivals)


@dataclass(eq=False)
class Pool:
    spec: PoolSpec
    instances: list[Instance] = field(default_factory=list)
    held_arrivals: list[float] = field(default_factory=list)
    """When each request waiting in the router for an instance (none ready: starting or
    re-sharding) arrived."""
    routed: int = 0
    idle_since: float | None = None
    queued_since: float | None = None
    refused_at: float | None = None
    """When an instance last refused a request of it for the TTFT target (429)."""
    @property
    def held(self) -> int:
        return len(self.held_arrivals)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ranks(self) -> int:
        return sum(len(i.ranks) for i in self.instances)

    def load(self) -> int:
        return self.held + sum(i.in_flight for i in self.instances)

    def seats(self, max_num_seqs: int) -> int:
        return max_num_seqs * sum(1 for i in self.instances if i.ready and not i.draining)


@dataclass(frozen=True)
class Move:
    donor: Pool
    receiver: Pool
    give: Instance
    """The donor's instance that is drained and stopped."""
    donor_keeps: tuple[int, ...]
    """Ranks of `give` the donor restarts on, re-sharded (empty: it just stops)."""
    freed: tuple[int, ...]
    grow: Instance | None
    """The receiver's instance re-sharded up over `freed` (None: a new instance on them)."""
    receiver_plan: str

    def describe(self) -> str:
        donor = (f"{self.donor.name} {self.give.plan} -> {tp_plan(len(self.donor_keeps))} (drain, re-shard, resume)"
                 if self.donor_keeps else f"{self.donor.name} stops an instance {self.give.plan}")
        receiver = (f"{self.receiver.name} {self.grow.plan} -> {self.receiver_plan} (drain, re-shard, resume)"
                    if self.grow else f"{self.receiver.name} starts an instance {self.receiver_plan}")
        count = len(self.freed)
        return f"{count} rank{'s' * (count > 1)} {self.donor.name} -> {self.receiver.name}: {donor}; {receiver}"


class Router:
    def __init__(self, specs: list[PoolSpec], max_num_seqs: int, move_after_s: float,
                 layout_ok: Callable[[str], bool] = lambda plan: True, ttft_s: float | None = None):
        """`layout_ok(plan)`: whether the model can run in that layout (tp divides its heads).
        `ttft_s`: the --ttft-ms target, which then says when a pool queues past its target."""
        self.pools = {spec.name: Pool(spec) for spec in specs}
        self.layout_ok, self.ttft_s = layout_ok, ttft_s
        self.max_num_seqs, self.move_after_s = max_num_seqs, move_after_s
        self.moving = False
        self.moves = 0
        self._next_ident = 0
        rank = 0
        for pool in self.pools.values():
            for _ in range(pool.spec.instances):
                pool.instances.append(self.new_instance(pool.spec.plan, tuple(range(rank, rank + pool.spec.world))))
                rank += pool.spec.world

    def new_instance(self, plan: str, ranks: tuple[int, ...]) -> Instance:
        self._next_ident += 1
        return Instance(plan, ranks, self._next_ident - 1)

    def classify(self, header: str | None, service_tier) -> Pool:
        """The pool of a request (see the module docstring)."""
        if header:
            if header not in self.pools:
                raise UnknownClass(f"X-Phalanx-Class {header!r}: this server's pools are {', '.join(self.pools)}")
            return self.pools[header]
        if service_tier is not None and (not isinstance(service_tier, str) or service_tier not in SERVICE_TIERS):
            raise UnknownClass(f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {service_tier!r}")
        wanted = SERVICE_TIERS.get(service_tier or "auto")
        return self.pools.get(wanted) or self.pools.get("throughput") or next(iter(self.pools.values()))

    def pick(self, pool: Pool) -> Instance | None:
        """The pool's ready instance with the fewest requests in flight (None: hold it)."""
        open_ = [i for i in pool.instances if i.ready and not i.draining]
        return min(open_, key=lambda i: i.in_flight) if open_ else None

    def oldest_wait(self, pool: Pool, now: float) -> float:
        """Seconds the longest-waiting request of `pool` has waited without a seat. An engine
        seats its requests oldest first (scheduler.py), so those beyond an instance's
        `--max-num-seqs` seats are its newest; requests held here have no instance at all.
        Measured, not predicted: the front sees when each request arrived, streamed or not,
        while a predicted queue TTFT would need each instance's step times (which only the
        instance's own SLO scheduler has). The SLO scheduler's TPOT limit may seat fewer than
        the seats, so this errs late, never early."""
        waits = [now - t for t in pool.held_arrivals]
        for instance in pool.instances:
            waits += [now - t for t in sorted(instance.arrivals)[self.max_num_seqs:]]
        return max(waits, default=0.0)

    def queued_past_target(self, pool: Pool, now: float) -> bool:
        if self.ttft_s is None:
            return pool.load() > pool.seats(self.max_num_seqs)
        refused = pool.refused_at is not None and now - pool.refused_at <= self.ttft_s
        return refused or self.oldest_wait(pool, now) > self.ttft_s

    def note_refused(self, pool: Pool, now: float) -> None:
        """An instance refused a request of `pool` at arrival for the TTFT target."""
        pool.refused_at = now

    def observe(self, now: float) -> None:
        """Note, at `now`, which pools idle and which queue past their target."""
        for pool in self.pools.values():
            if pool.load():
                pool.idle_since = None
            elif pool.idle_since is None:
                pool.idle_since = now
            if self.queued_past_target(pool, now):
                pool.queued_since = now if pool.queued_since is None else pool.queued_since
            else:
                pool.queued_since = None

    def plan_move(self, now: float) -> Move | None:
        """The move to make now, if one pool has idled and another queued for `move_after_s`."""
        if self.moving:
            return None
        waited = lambda since: since is not None and now - since >= self.move_after_s  # noqa: E731
        queued = [p for p in self.pools.values() if waited(p.queued_since)]
        idle = [p for p in self.pools.values() if waited(p.idle_since)]
        for receiver in sorted(queued, key=lambda p: -p.load()):
            for donor in idle:
                move = self._move(donor, receiver)
                if move is not None:
                    return move
        return None

    def _move(self, donor: Pool, receiver: Pool) -> Move | None:
        ready = [i for i in donor.instances if i.ready and not i.draining]
        if not ready or any(not i.ready for i in receiver.instances):
            return None
        if len(ready) > 1:
            give, keeps = ready[-1], ()
        elif (len(ready[0].ranks) >= 2 and ready[0].plan == tp_plan(len(ready[0].ranks))
              and self.layout_ok(tp_plan(len(ready[0].ranks) // 2))):
            give = ready[0]
            keeps = give.ranks[:len(give.ranks) // 2]
        else:
            return None  # its one instance cannot be split further
        freed = give.ranks[len(keeps):]
        shrunk = [i for i in receiver.instances if len(i.ranks) < receiver.spec.world]
        if shrunk and len(shrunk[0].ranks) + len(freed) == receiver.spec.world:
            return Move(donor, receiver, give, keeps, freed, shrunk[0], receiver.spec.plan)
        plan = receiver.spec.plan if len(freed) == receiver.spec.world else tp_plan(len(freed))
        if not self.layout_ok(plan):
            return None
        return Move(donor, receiver, give, keeps, freed, None, plan)
