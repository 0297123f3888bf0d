"""What the planner evaluates: a Plan plus the knobs the trainer's Plan does not carry.

`Layout` is a Plan with the micro-batch size (sequences per micro-batch) and the ZeRO level
made explicit: zero=0 is a replicated optimizer (fsdp=false in the Plan), zero=1 and 2 are
the sharded-optimizer variants that published runs used (Megatron's distributed optimizer is
zero=1), zero=3 is fully sharded (fsdp=true).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from phalanx.errors import UserError
from phalanx.plan import Plan


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


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One candidate: every knob fixed."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    mbs: int = 1
    """Sequences per micro-batch."""
    microbatches: int = 1
    """Micro-batches per step per data-parallel rank: global_batch / (dp * mbs)."""
    schedule: str = "1f1b"
    virtual: int = 1
    recompute: str = "none"
    recompute_layers: int = 0
    """With recompute: blocks checkpointed per model chunk (0 = all)."""
    zero: int = 0
    """0 replicated, 1 optimizer state sharded, 2 + gradients, 3 + parameters (fsdp)."""
    sp: bool = False
    replicate: int = 1
    """With zero=3: HSDP, shard within dp / replicate ranks and all-reduce across replicas."""
    offload: bool = False
    """With zero=3 and dp > 1: weights, gradients and optimizer state on the host (FSDP2's
    CPUOffloadPolicy). The search offers it only where nothing else fits."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def to_plan(self) -> Plan:
        """The trainer's Plan. zero=1 (the published runs' distributed optimizer) has no trainer
        equivalent and reads as zero=0 here; `to_string` keeps it, and the search offers the
        trainer only the levels it runs (0, 2, 3)."""
        return Plan(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, zero=self.zero if self.zero != 1 else 0,
                    replicate=self.replicate, sp=self.sp, schedule=self.schedule, virtual=self.virtual,
                    microbatches=self.microbatches, recompute=self.recompute,
                    recompute_layers=self.recompute_layers, offload=self.offload)

    def to_string(self) -> str:
        """A `--fix` string that gives back exactly this layout (the zero level always named)."""
        keys = [part for part in self.to_plan().to_string().split(",") if not part.startswith("zero=")]
        return ",".join([*keys, f"mbs={self.mbs}", f"zero={self.zero}"])

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)
