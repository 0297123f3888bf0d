"""This rank's compute time and time waiting in collectives, per step, for the step's one
all-reduce (step_sync.py) to carry to every rank.

What is counted where:
- the step runs from its start (the batch read) to just before its bookkeeping all-reduce;
  `wait_s` is the part of it measured as waiting, `compute_s` the rest: the forward, the
  backward, the gradient clipping and the host work between them. The bookkeeping all-reduce
  itself and the optimizer update (after it) are in neither.
- replicated data parallelism (DDP): a hook on every parameter notes when its gradient is
  accumulated; the last one of a backward ends the rank's own backward compute. DDP all-reduces
  gradient buckets as they fill, in the background, and waits for all of them at the end of
  the backward, so from the last gradient to the end of `backward()` the rank waits: for its
  peers' gradients (the slower ranks) and for the transfers still in flight. That span is
  `wait_s`. A bucket's all-reduce that overlaps the rank's compute costs the rank only the CPU
  it takes (on gloo, its threads): compute.
- pipelines: the host time blocked on point-to-point transfers (`pipeline_step.WaitClock`) and
  in the loss's all-reduce after the schedule.
- expert parallelism: the host time inside the token dispatch's all-to-alls, forward and
  backward (`parallel/expert_dispatch.take_dispatch_waits`), and in the sum of the expert
  replicas' gradients (the step adds it). On gloo the host blocks in them until the slower
  peers' rows arrive; with NCCL they return once queued, so on CUDA these waits are not
  measured (and expert placement does not weigh measured speeds there: train/expert_speeds.py).
- elsewhere (tp, cp, FSDP's gathers and reduce-scatters) collectives sit inside the forward
  and backward and are counted as compute: their waits are not separated yet, and such
  layouts keep equal data-parallel shares (`adapt_policy.adaptation_refusal`).

On CUDA the hooks record CUDA events instead of reading the host clock (the host runs ahead of
the device): the wait is the device time from the last gradient's kernels to the end of the
gradient reduction on the compute stream (which waits for NCCL's stream there), read after the
backward's end event completes; that host sync comes just before the step's bookkeeping
all-reduce, whose `.tolist()` would wait for the device anyway.
"""

from __future__ import annotations

import time

import torch
from torch.nn.parallel import DistributedDataParallel

from phalanx.parallel.expert_dispatch import take_dispatch_waits


class RankClock:
    """`begin()` at the step's start; wrap each backward in `backward()`; `add_wait(s)` for
    waits measured elsewhere (pipelines); `read()` before the step's all-reduce."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        """Under DDP, hooks on `model`'s parameters note each gradient (see the module docstring)."""
        self.cuda = device.type == "cuda"
        self.began = 0.0
        self.waited = 0.0
        self.last_grad: float | torch.cuda.Event | None = None
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: (last gradient, backward end)
        self.handles = []
        if isinstance(model, DistributedDataParallel):
            for param in model.parameters():
                if param.requires_grad:
                    self.handles.append(param.register_post_accumulate_grad_hook(self._gradient_ready))

    def _gradient_ready(self, _param) -> None:
        if self.cuda:
            if self.last_grad is None:
                self.last_grad = torch.cuda.Event(enable_timing=True)
            self.last_grad.record()  # re-recorded by each later gradient: the last one stands
        else:
            self.last_grad = time.perf_counter()

    def begin(self) -> None:
        take_dispatch_waits()  # what validation or the last step left: not this step's
        self.began, self.waited, self.spans = time.perf_counter(), 0.0, []

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, timing the wait after this rank's last gradient."""
        self.last_grad = None
        loss.backward()
        if self.last_grad is None:  # no hook (not DDP), or no parameter got a gradient
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((self.last_grad, end))
        else:
            self.waited += time.perf_counter() - self.last_grad

    def add_wait(self, seconds: float) -> None:
        self.waited += seconds

    def read(self) -> tuple[float, float]:
        """(compute_s, wait_s) of the step so far."""
        for last_grad, end in self.spans:
            end.synchronize()
            self.waited += last_grad.elapsed_time(end) / 1000
        self.spans = []
        self.waited += take_dispatch_waits()
        total = time.perf_counter() - self.began
        return max(total - self.waited, 0.0), self.waited

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
