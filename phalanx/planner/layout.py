"""What the planner evaluates: the trainer's Plan plus the knobs only planning needs.

A `Layout` holds the `Plan` that `phalanx train --plan` would run, and beside it the micro-batch
size (sequences per micro-batch, which the trainer derives from the global batch) and the
planner-only ZeRO-1 level: the distributed optimizer that published Megatron runs used
(optimizer state sharded over dp, gradients and parameters whole). The trainer does not offer
ZeRO-1 (its checkpoints would not reshard through DCP), so such a layout's plan reads zero=0;
the search offers it only when asked (`--zero-levels 1`), to model those runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.errors import UserError
from phalanx.plan import Plan

"""Whether the trainer's Plan carries context parallelism (issue 24 adds `Plan.cp`). Until it
does, the layout holds cp itself, as it holds the planner-only ZeRO-1 flag, and the layout's
world size and `--fix` string include it; once it does, cp lives in the plan like dp."""


MAX_STEP_TOKENS = 2**36
"""Tokens one optimizer step may process: the bound of every workload."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one optimizer step processes."""

    global_batch: int
    """Sequences per optimizer step, over all data-parallel ranks."""
    seq_len: int
    """Tokens per sequence."""

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1:
            raise UserError(f"global_batch={self.global_batch} and seq_len={self.seq_len} must be at least 1")
        tokens = self.global_batch * self.seq_len
        if tokens > MAX_STEP_TOKENS:
            raise UserError(f"--global-batch {self.global_batch} x --seq-len {self.seq_len} = {tokens:.3g} tokens per "
                            f"step; at most {MAX_STEP_TOKENS:.2g}, a thousand times what the largest published runs "
                            "take (about 6e7: DeepSeek-V3, Llama 3)")


@dataclass(frozen=True, init=False)
class Layout:
    """One candidate: a Plan with every knob fixed, its micro-batch size and the ZeRO-1 flag.

    Built from a plan, `Layout(plan, mbs=2)`, or spelled flat with the plan's keys,
    `Layout(dp=4, cp=2, tp=2, microbatches=8, mbs=2, zero=1)`, where zero=1 sets `zero1` (and
    the plan's zero=0) and microbatches defaults to 1 rather than the trainer's "pick one" (0).
    Every plan key reads through it (`layout.dp`, `layout.schedule`, `layout.world_size`), and
    `layout.zero` is 1 for the distributed optimizer, else the plan's level.
    """

    plan: Plan
    """What the trainer runs (zero 0, 2 or 3)."""
    mbs: int = 1
    """Sequences per micro-batch: global_batch = dp * mbs * plan.microbatches."""
    zero1: bool = False
    """The distributed optimizer (ZeRO-1): optimizer state sharded over dp, on a plan with zero=0."""

    def __init__(self, plan: Plan | None = None, *, mbs: int = 1, zero1: bool = False, cp: int | None = None,
                 **plan_keys) -> None:
        if plan is not None and plan_keys:
            raise TypeError(f"Layout takes a plan or its keys, not both: {sorted(plan_keys)}")
        if plan is None:
            if plan_keys.get("zero") == 1:
                plan_keys["zero"], zero1 = 0, True
            if cp is not None:
                plan_keys["cp"] = cp
            plan = Plan(**{"microbatches": 1, **plan_keys})
        elif cp is not None and cp != plan.cp:
            plan = plan.replace(cp=cp)
        if zero1 and plan.zero:
            raise UserError(f"zero=1 (the distributed optimizer) contradicts the plan's zero={plan.zero}")
        cp = plan.cp
        if cp < 1:
            raise UserError(f"cp={cp} must be at least 1")
        # The plan's keys read through the layout (`layout.dp` is `layout.plan.dp`), and `zero`
        # (0 replicated, 1 optimizer state sharded, 2 + gradients, 3 + parameters): copied once
        # rather than looked up through properties, since a search reads them a million times.
        # `replicas`: the ranks holding the same weights and different tokens, dp x cp, over
        # which gradients are reduced, zero levels shard and experts spread.
        world = plan.world_size
        self.__dict__.update(vars(plan), cp=cp, replicas=plan.dp * cp, world_size=world,
                             zero=1 if zero1 else plan.zero, plan=plan, mbs=mbs, zero1=zero1)

    def plan_string(self) -> str:
        """The `--plan` string of what the trainer runs."""
        return self.plan.to_string()

    def to_string(self) -> str:
        """A `--fix` string that gives back exactly this layout (the zero level always named)."""
        keys = [part for part in self.plan_string().split(",") if not part.startswith("zero=")]
        return ",".join([*keys, f"mbs={self.mbs}", f"zero={self.zero}"])

    def replace(self, **changes) -> "Layout":
        """A copy with some knobs changed, named as in the flat spelling (zero=1 included)."""
        mbs, zero1, cp = changes.pop("mbs", self.mbs), changes.pop("zero1", self.zero1), changes.pop("cp", self.cp)
        if "zero" in changes:
            zero1 = changes["zero"] == 1
            changes["zero"] = 0 if zero1 else changes["zero"]
        return Layout(self.plan.replace(**changes) if changes else self.plan, mbs=mbs, zero1=zero1, cp=cp)


