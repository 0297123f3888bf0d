"""What a training framework costs beyond the FLOPs, bytes and collectives the cost model
charges: launches, Python, DTensor dispatch, FSDP hooks, DDP's bucket waits, the pipeline
runtime's per-action work, activation checkpointing's bookkeeping.

`phalanx calibrate` measures these on a CPU, where gloo and the framework share the cores
that compute; on the GPU presets they are 0 (hidden by asynchrony). A `Cluster` holds one
`FrameworkCosts` beside its hardware figures; in a cluster file their keys sit at the top
level with the hardware's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class FrameworkCosts:
    """Measured framework overheads of one machine's runtime, per device."""

    layer_overhead_us: float = 0.0
    """Fixed time per layer per micro-batch per pass that no FLOP count explains (launches, Python)."""
    step_overhead_ms: float = 0.0
    """Fixed time per optimizer step besides the layers (loss, clipping, optimizer launches)."""
    optimizer_layer_overhead_us: float = 0.0
    """Fixed time per layer per optimizer step of clipping, AdamW and zeroing beyond their
    bytes (per-tensor work): measured on CPUs, 0 on the GPU presets."""
    fsdp_unit_overhead_us: float = 0.0
    """Framework time FSDP adds per sharded layer per micro-batch (hooks, copies, waits) beyond
    its collectives' alpha-beta time: measured on CPUs, hidden by GPU asynchrony (0)."""
    tp_layer_overhead_us: float = 0.0
    """Framework time tensor parallelism adds per layer per pass (DTensor dispatch) beyond its
    collectives: measured on CPUs, hidden by GPU asynchrony (0)."""
    tp_element_overhead_ns: float = 0.0
    """Framework time tensor parallelism adds per activation element (tokens x dim of the
    micro-batch) per layer per pass, beyond its collectives' bytes (DTensor redistribution
    copies, which grow with the activation): measured on CPUs from 8 tokens to a real
    micro-batch, 0 on the GPU presets."""
    sp_layer_overhead_us: float = 0.0
    """Framework time sequence parallelism adds per layer per pass on top of
    `tp_layer_overhead_us` (its norms run as DTensors, the gathers and scatters around the
    column/row-wise regions): measured on CPUs with phalanx's own plan, 0 on the GPU presets."""
    tp_microbatch_overhead_us: float = 0.0
    """Framework time tensor parallelism (with sp) adds per micro-batch beyond its layers: the
    embedding, output and vocabulary-parallel loss as DTensors; measured on CPUs, 0 on GPUs."""
    tp_optimizer_layer_overhead_us: float = 0.0
    """Framework time per layer per optimizer step that clipping, AdamW and zeroing add on
    tensor-parallel (DTensor) parameters; measured on CPUs, 0 on GPUs."""
    ddp_step_overhead_ms: tuple[tuple[int, float], ...] = ()
    """(processes, ms per step) DDP's gradient sync costs beyond its all-reduce's alpha-beta
    time, measured by calibrate on CPUs (the bucket all-reduce waits for cores busy with the
    backward); () on the GPU presets."""
    fsdp_unit_overhead_groups: tuple[tuple[int, float], ...] = ()
    """(processes, us) `fsdp_unit_overhead_us` measured by calibrate at each group size, the
    contention of that many processes on the cores included; () on the GPU presets."""
    fsdp_pp_unit_overhead_us: float = 0.0
    """Framework time per FSDP unit per optimizer step under pipeline parallelism, where the
    trainer keeps the weights gathered and reduces gradients once, after the last micro-batch;
    measured on CPUs, 0 on GPUs."""
    fsdp_pp_microbatch_overhead_us: float = 0.0
    """The same per unit per micro-batch (FSDP's hooks around every forward and backward)."""
    fsdp_pp_overhead_groups: tuple[tuple[int, float, float], ...] = ()
    """(processes, us per unit per step, us per unit per micro-batch): the two above measured
    at each group size, contention included (CPUs)."""
    pp_action_overhead_us: tuple[tuple[str, float], ...] = ()
    """(schedule, us) the pipeline runtime costs per action (one chunk's forward, backward,
    input- or weight-gradient of one micro-batch) beyond the stage's compute and its sends'
    bytes: measured by calibrate on CPUs for 1f1b (gpipe too), interleaved, zbv and dualpipev."""
    recompute_overhead_us: float = 0.0
    """Framework time activation checkpointing adds per layer per micro-batch besides the
    recomputed forward: measured on CPUs, 0 on GPUs."""
    split_rerun_overhead_us: float = 0.0
    """The same for each of the forward re-runs a checkpointed block makes under a split
    backward (zbv: one per weight tensor): measured on phalanx's zbv pipeline on CPUs, 0 on GPUs."""

    def problems(self) -> list[str]:
        """Every figure is a time: finite and not negative (a negative one ranks plans by it)."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            rows = value if isinstance(value, tuple) else ((value,),)
            for row in rows:
                numbers = [x for x in (row if isinstance(row, tuple) else (row,)) if not isinstance(x, str)]
                if any(not math.isfinite(x) or x < 0 for x in numbers):
                    out.append(f"{f.name}={_show(value)} must be finite and not negative")
                    break
        return out

    def fsdp_pp_unit_s(self, size: int, microbatches: int, queueing: float) -> float:
        """Seconds FSDP adds per unit per step under pp on `size` processes: measured at that
        size, or the 2-process figures shared out like other fixed costs (`queueing`)."""
        if self.fsdp_pp_overhead_groups:
            step = by_size(tuple((n, a) for n, a, _ in self.fsdp_pp_overhead_groups), size)
            per_mb = by_size(tuple((n, b) for n, _, b in self.fsdp_pp_overhead_groups), size)
            return (step + microbatches * per_mb) * 1e-6
        return (self.fsdp_pp_unit_overhead_us + microbatches * self.fsdp_pp_microbatch_overhead_us) * 1e-6 * queueing

    def ddp_overhead_s(self, size: int) -> float:
        """Seconds per step DDP adds beyond its all-reduce on `size` processes."""
        return by_size(self.ddp_step_overhead_ms, size) * 1e-3

    def fsdp_unit_s(self, size: int, queueing: float) -> float:
        """Seconds FSDP adds per unit per micro-batch on `size` processes: measured at that
        size, or the 2-process figure shared out like other fixed costs (`queueing`)."""
        if self.fsdp_unit_overhead_groups:
            return by_size(self.fsdp_unit_overhead_groups, size) * 1e-6
        return self.fsdp_unit_overhead_us * 1e-6 * queueing

    def pp_action_s(self, schedule: str) -> float:
        """Seconds the pipeline runtime adds per action of `schedule` (gpipe runs 1f1b's)."""
        name = "1f1b" if schedule == "gpipe" else schedule
        return next((us * 1e-6 for s, us in self.pp_action_overhead_us if s == name), 0.0)


FIELD_NAMES = tuple(f.name for f in fields(FrameworkCosts))


def by_size(rows: tuple[tuple[int, float], ...], size: int) -> float:
    """A figure measured per group size: that size's, else the nearest measured one scaled by
    the size ratio (0 with no measurement)."""
    if not rows or size < 2:
        return 0.0
    n, value = min(rows, key=lambda row: abs(row[0] - size))
    return value * size / n


def _show(value) -> str:
    return str([list(r) for r in value]) if isinstance(value, tuple) else repr(value)
