"""When and where expert slots move, in training (`--rebalance-every K`) and while serving; torch-free.

The trainer already sums each step's tokens per expert over the data-parallel ranks
(`phalanx.train.moe_stats.end_step`: `expert_tokens` per MoE layer, identical on every rank).
`ExpertRebalancer.observe` folds them into a moving average and, every K steps, re-plans all
MoE layers at once with the balancer's incremental solver (`phalanx.balance.solve.rebalance`
with `previous`: few slots change). Every rank feeds it the same numbers and the solver is
deterministic, so every rank gets the same placement without exchanging it.

The event row it returns is the one metrics.jsonl records (docs/expert_slots.md):
`{"event": "rebalance", "step", "imbalance_before", "imbalance_after", "moved_slots", "bytes_moved"}`
with per-rank imbalance (max - mean) / mean, averaged over the MoE layers: measured before
(the average of the tokens each ep rank received, when the trainer passes them) and predicted
after (the balancer's model: a replica carries load / replicas of its expert). A new placement
that the model predicts no more even than the measured one is not made (`moved_slots` 0, the
imbalance after = before); after a move the measured average starts again, on the new placement.

`phalanx.balance.slot_copies.copy_sources` decides which old slot each new slot copies from;
the weight move (`phalanx.parallel.expert_slot_moves`) and `bytes_moved` both use it, so the
figure is the bytes that the move really sends between ranks.

Ranks of different speeds (issue 40): given `speed_rules` (`adapt_policy.AdaptRules`),
`observe` also takes each ep rank's measured speed; each rank's median over the last `window`
steps (8: one slow step moves nothing) weights the placement (`balance/speed_weighted.py`: a
rank's time is its load over its speed, and the times are evened) once the window is full and
the fastest is more than `band` (10%) above the slowest; until then they count as equal, the
placement is the balancer's usual one and the row has no `speeds`. Imbalance is then of the
ranks' times (load / relative speed), before and after, and a move is made when it lowers the
slowest rank's time (averaged over the layers).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import median

import numpy as np

from phalanx.adapt_policy import AdaptRules
from phalanx.balance import measure
from phalanx.balance.slot_copies import remote_copies
from phalanx.balance.solve import rebalance
from phalanx.errors import UserError

DEFAULT_DECAY = 0.9
"""Weight of the past in the load average: about the last 10 steps count (1 / (1 - decay))."""


@dataclass(frozen=True)
class RebalanceEvent:
    step: int
    imbalance_before: float
    imbalance_after: float
    moved_slots: int
    bytes_moved: int
    speeds: list[float] | None = None
    """The ep ranks' relative speeds the placement was weighted by (None: taken as equal)."""

    def row(self) -> dict:
        """The metrics.jsonl event row; keys kept exactly as issue 13 names them, and `speeds`
        (issue 40) when the ranks' speeds weighted it."""
        row = {"event": "rebalance", **asdict(self)}
        if self.speeds is None:
            del row["speeds"]
        return row


def loads_from_record(moe_record: dict, ep: int) -> tuple[np.ndarray, np.ndarray]:
    """(expert_tokens (layers, experts), rank_tokens (layers, ep)) from `moe_stats.end_step`'s
    `"moe"` record, MoE layers in layer order, for `ExpertRebalancer.observe`.

    The record's `rank_tokens` are per dp rank; dp rank d is ep rank d % ep of edp group
    d // ep (`ParallelMesh.split_dp`, ep ranks adjacent), so an ep rank's load is the sum over
    the edp groups: the slots an ep rank holds are the same in every ep group.
    """
    layers = sorted(moe_record, key=int)
    experts = np.array([moe_record[layer]["expert_tokens"] for layer in layers], dtype=float)
    per_dp_rank = np.array([moe_record[layer]["rank_tokens"] for layer in layers], dtype=float)  # (layers, dp)
    if per_dp_rank.shape[1] % ep:
        raise UserError(f"the record has {per_dp_rank.shape[1]} dp ranks, not a multiple of ep={ep}")
    return experts, per_dp_rank.reshape(len(layers), -1, ep).sum(axis=1)


def initial_placement(layers: int, n_experts: int, slots: int, ep: int) -> np.ndarray:
    """(layers, S) placement before any load is known.

    S == E: slot e holds expert e, today's layout (expert e on rank e // (E / ep)), so a run
    with default slots starts exactly as before. S > E: the balancer's placement for even
    loads (the extra slots spread replicas evenly over the ranks).
    """
    if slots == n_experts:
        return np.tile(np.arange(n_experts), (layers, 1))
    return rebalance(np.ones((layers, n_experts)), slots, 1, 1, ep, policy="global").phy2log


class ExpertRebalancer:
    """The load average and the placement of every MoE layer; one per trainer, same on every rank."""

    def __init__(self, phy2log, n_experts: int, ep: int, *, every: int, slot_bytes: int,
                 decay: float = DEFAULT_DECAY, speed_rules: AdaptRules | None = None):
        """phy2log: (MoE layers, S) the current slot -> expert rows (one per layer);
        slot_bytes: bytes of one slot's weights and optimizer state (what a moved slot sends);
        speed_rules: how the ep ranks' speeds weigh the placement (None: they do not)."""
        if every < 1:
            raise UserError(f"--rebalance-every={every} must be at least 1")
        if not 0 <= decay < 1:
            raise UserError(f"the load average's decay={decay} must be in [0, 1)")
        self.phy2log = np.array(phy2log, dtype=np.int64, ndmin=2)  # (layers, S)
        self.n_experts, self.ep, self.every, self.decay = n_experts, ep, every, decay
        self.slot_bytes = slot_bytes
        self.expert_load: np.ndarray | None = None  # (layers, experts) moving average
        self.rank_load: np.ndarray | None = None  # (layers, ep) moving average of measured arrivals
        self.speed_rules = speed_rules
        self.speeds: list[list[float]] = []  # the last `window` steps' ep rank speeds, each step's fastest 1

    def _average(self, current: np.ndarray | None, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=float)
        return tokens.copy() if current is None else self.decay * current + (1 - self.decay) * tokens

    def weights(self) -> np.ndarray | None:
        """The ep ranks' relative speeds to weight the placement by (each one's median over the
        window, the fastest 1), or None while the window is not full or they are within the
        band of each other: equal."""
        rules = self.speed_rules
        if rules is None or len(self.speeds) < rules.window:
            return None
        smooth = np.array([median(step[e] for step in self.speeds) for e in range(self.ep)])
        if smooth.max() <= smooth.min() * (1 + rules.band):
            return None
        return smooth / smooth.max()

    def observe(self, step: int, expert_tokens, rank_tokens=None, speeds=None) -> RebalanceEvent | None:
        """Fold in one step's loads; on every K-th step re-plan and return the event (else None).

        expert_tokens: (layers, experts) this step's tokens per expert, summed over dp;
        rank_tokens: (layers, ep) tokens each ep rank's slots computed, if measured;
        speeds: (ep,) each ep rank's speed this step (any unit), if measured.
        After an event, `phy2log` is the new placement; the caller moves the slots
        (`copy_sources` says from where) before the next forward.
        """
        expert_tokens = np.asarray(expert_tokens, dtype=float)
        if expert_tokens.shape != (len(self.phy2log), self.n_experts):
            raise UserError(f"expert loads of shape {expert_tokens.shape}, expected {(len(self.phy2log), self.n_experts)} (MoE layers, experts)")
        self.expert_load = self._average(self.expert_load, expert_tokens)
        if rank_tokens is not None:
            rank_tokens = np.array(rank_tokens, dtype=float, ndmin=2)
            if rank_tokens.shape != (len(self.phy2log), self.ep):
                raise UserError(f"rank loads of shape {rank_tokens.shape}, expected {(len(self.phy2log), self.ep)} (MoE layers, ep ranks)")
            self.rank_load = self._average(self.rank_load, rank_tokens)
        if speeds is not None and self.speed_rules is not None:
            speeds = np.asarray(speeds, dtype=float)
            if speeds.shape != (self.ep,) or not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
                raise UserError(f"rank speeds {speeds.tolist()}: expected {self.ep} positive numbers (ep ranks)")
            self.speeds = [*self.speeds, (speeds / speeds.max()).tolist()][-self.speed_rules.window:]
        if step < 1 or step % self.every:
            return None
        old = self.phy2log
        weights = self.weights()
        scale = 1.0 if weights is None else weights  # a rank's time: its load over its relative speed
        before = self.rank_load if self.rank_load is not None else measure.gpu_loads(self.expert_load, old, self.ep)
        imbalance_before = float(measure.imbalance(before / scale).mean())
        # One node, global policy: phalanx's routers pick experts without group limits, so the
        # balancer's hierarchical policy (groups packed onto nodes) has nothing to work with.
        result = rebalance(self.expert_load, old.shape[1], 1, 1, self.ep, policy="global", previous=old, speeds=weights)
        after = measure.gpu_loads(self.expert_load, result.phy2log, self.ep) / scale
        imbalance_after = float(measure.imbalance(after).mean())
        shown = None if weights is None else [round(float(w), 4) for w in weights]
        # With equal speeds every layout of a layer's load has the same mean, so the imbalance
        # orders them as the top rank's load does; with speeds the mean time changes too, and the
        # step waits on the slowest rank: compare its time.
        no_gain = (imbalance_after >= imbalance_before if weights is None
                   else after.max(axis=1).mean() >= (before / scale).max(axis=1).mean() * (1 - 1e-12))
        if no_gain:
            # A move sends weights and stalls a step; one that promises no less imbalance than
            # what is measured now (an even load, or the balancer's best is already in place)
            # is not made: the placement, and so the imbalance, stay as they are.
            return RebalanceEvent(step=step, imbalance_before=imbalance_before, imbalance_after=imbalance_before,
                                  moved_slots=0, bytes_moved=0, speeds=shown)
        self.phy2log = result.phy2log
        if measure.moved_slots(self.phy2log, old):
            # The measured arrivals were the old placement's: the next decision measures the new one.
            self.rank_load = None
        return RebalanceEvent(
            step=step,
            imbalance_before=imbalance_before,
            imbalance_after=imbalance_after,
            moved_slots=measure.moved_slots(self.phy2log, old),
            bytes_moved=remote_copies(old, self.phy2log, self.ep) * self.slot_bytes,
            speeds=shown,
        )

    def state_dict(self) -> dict:
        """What a checkpoint keeps so a resumed run routes and re-plans as the saved one would."""
        as_list = lambda a: None if a is None else a.tolist()  # noqa: E731
        return {"phy2log": self.phy2log.tolist(), "expert_load": as_list(self.expert_load), "rank_load": as_list(self.rank_load),
                "speeds": self.speeds}

    def load_state_dict(self, state: dict) -> None:
        phy2log = np.array(state["phy2log"], dtype=np.int64, ndmin=2)
        if phy2log.shape != self.phy2log.shape:
            raise UserError(f"the checkpoint's expert placement is {phy2log.shape} (layers, slots), this run's {self.phy2log.shape}")
        self.phy2log = phy2log
        as_array = lambda a: None if a is None else np.array(a, dtype=float)  # noqa: E731
        self.expert_load, self.rank_load = as_array(state["expert_load"]), as_array(state["rank_load"])
        self.speeds = list(state.get("speeds") or [])  # absent in checkpoints from before issue 40
