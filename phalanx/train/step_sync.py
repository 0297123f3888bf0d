"""Each step's one small collective: the global loss, the stop signal, and every rank's peak
memory, compute time and time waiting in collectives, in a single all-reduce over all ranks,
which is also the step's liveness check.

The packed tensor (float64, on the mesh's device, so NCCL or gloo carries it like any other):

    [loss_sum, ranks that got SIGTERM, ranks that got SIGINT, joules of the ranks' GPUs,
     ranks whose GPU's energy was read, peak MB of rank 0 .. rank P-1,
     compute s of rank 0 .. P-1, wait s of rank 0 .. P-1]

Each rank fills its own slots and zeros elsewhere, so one sum gives all of it. The loss is the
same on every tp and pp rank of a data-parallel replica (tensor parallelism replicates it, the
pipeline sums it over its stages), so the sum over all P ranks divided by P is the mean over
the dp ranks, the global batch's mean loss. A stop signal noted on any rank before its
collective stops every rank after that same step (SIGTERM wins over SIGINT, as a scheduler's
preemption should); the peak is each rank's peak so far, read before the step's optimizer
update; the times are the rank's own (phalanx/train/rank_clock.py says what each counts), and
every rank receives all of them, so every rank's adaptation decides alike
(phalanx/adapt_policy.py). On CUDA each rank's GPU's energy since the last step's
agreement (NVML's counter: gpu_energy.py) is read after the device has finished the step's
queued work (a device synchronize just before this collective, which waits for that work
anyway), and summed: the row's `energy_j` is the energy of all the ranks' GPUs from the
previous step's all-reduce to this one's (the previous step's optimizer update, validation and
checkpoint, and this step's forward and backward), present only when every rank read its own;
on CPU none is read. Cost per step: one all-reduce of 8 (3P + 5) bytes (a tree: O(log P) latency under NCCL;
gloo's ring), instead of a monitored barrier through rank 0 (O(P)), a stop-flag all-reduce, the
loss all-reduce and a peak-memory all-gather. A rank that never arrives makes it (or an earlier
collective of the step) time out; collective_watch.py then names the rank.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.train.gpu_energy import EnergyCounter
from phalanx.train.stop_signal import StopSignals

_STOPS = (signal.SIGTERM, signal.SIGINT)
"""Stop signals in the order they win."""
_HEAD = 1 + len(_STOPS) + 2
"""The packed tensor's slots before the per-rank ones: loss, stops, joules, ranks that read them."""


@dataclass(frozen=True)
class StepAgreement:
    loss: float
    """The global batch's mean loss."""
    stop: int
    """The signal every rank stops for after this step; 0: go on."""
    peak_mb_by_rank: list[float] | None
    """Every rank's peak memory (MB) so far, in rank order; None without a process group."""
    compute_s_by_rank: list[float] | None = None
    """Every rank's compute time this step (s), in rank order; None without a process group."""
    wait_s_by_rank: list[float] | None = None
    """Every rank's time waiting in the step's measured collectives (s), in rank order."""
    energy_j: float | None = None
    """Joules all ranks' GPUs drew since the last agreement (NVML); None on CPU or where a
    rank could not read its GPU's counter."""


class StepSync:
    """Call `agree(loss_sum, peak_mb)` once per step on every rank, in the same place."""

    def __init__(self, device: torch.device, stop: StopSignals | None, energy: EnergyCounter | None = None):
        """`energy`: this rank's GPU's energy counter (run_setup.energy_counter), None on CPU."""
        self.device, self.stop, self.energy = device, stop, energy
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.steps = 0
        self.agreed_stop = 0

    def stop_before_step(self) -> int:
        """The signal to stop for before the next step (0: go on): what the last step's
        collective agreed; one process asks its own handlers. Never before this run's first
        step, so a signal during setup still lets one step run and leave a checkpoint."""
        if not self.steps or self.stop is None:
            return 0
        return self.stop.received if self.world == 1 else self.agreed_stop

    def agree(self, loss_sum: torch.Tensor, peak_mb: float, compute_s: float = 0.0, wait_s: float = 0.0) -> StepAgreement:
        """Collective: this rank's share of the step's loss (a scalar tensor), its peak memory,
        and its compute and wait seconds in this step."""
        self.steps += 1
        joules = self.read_energy()
        if self.world == 1:  # nothing to agree on; a process group of one still lists its rank's figures
            listed = dist.is_initialized()
            return StepAgreement(loss=float(loss_sum), stop=self.stop.received if self.stop else 0,
                                 peak_mb_by_rank=[round(peak_mb, 1)] if listed else None,
                                 compute_s_by_rank=[round(compute_s, 6)] if listed else None,
                                 wait_s_by_rank=[round(wait_s, 6)] if listed else None, energy_j=joules)
        got = self.stop.received if self.stop else 0
        extra = [float(got == sig) for sig in _STOPS] + [joules or 0.0, float(joules is not None)] + [0.0] * (3 * self.world)
        slots = _HEAD - 1 + self.rank
        extra[slots], extra[slots + self.world], extra[slots + 2 * self.world] = peak_mb, compute_s, wait_s
        packed = torch.cat([loss_sum.detach().reshape(1).to(torch.float64),
                            torch.tensor(extra, dtype=torch.float64, device=self.device)])  # (5 + 3 world,)
        dist.all_reduce(packed)
        values = packed.tolist()  # the step's one host sync
        self.agreed_stop = next((int(sig) for sig, count in zip(_STOPS, values[1:]) if count), 0)
        energy_j, read_by = values[_HEAD - 2 : _HEAD]
        peaks, computes, waits = (values[_HEAD + i * self.world : _HEAD + (i + 1) * self.world] for i in range(3))
        return StepAgreement(loss=values[0] / self.world, stop=self.agreed_stop, peak_mb_by_rank=[round(v, 1) for v in peaks],
                             compute_s_by_rank=[round(v, 6) for v in computes], wait_s_by_rank=[round(v, 6) for v in waits],
                             energy_j=energy_j if read_by == self.world else None)

    def read_energy(self) -> float | None:
        """This rank's GPU's joules since the last agreement, or None (CPU, no counter, a failed
        read). The device first finishes the work queued so far, so the reading's point is the
        same on the device as on the host; the agreement's host sync would wait for it anyway."""
        if self.energy is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.energy.read_j()
