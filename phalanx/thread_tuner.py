"""How many intra-op threads a serving engine's steps run on, re-decided from their own speed
while it serves. Torch-free: the engine loop applies the count (`serve/engine_loop.py`).

Why: the automatic count (`threads.py`) is every core this process may use, which is right on a
quiet machine and wrong beside a busy process. A step runs its OpenMP team in lockstep, so
when one of the cores is taken by another process the step waits for the thread the kernel
preempted there: `benchmarks/serve_vs_vllm.py --contention` (a busy process pinned to core 0 of
the 2-core machine) served one request at 0.63 of vLLM, whose one model thread is bound to the
other core; with `--threads 1` a thread of ours could have run there whole. Which count is
faster depends on what else runs, and that changes while a server runs, so it is measured:

- the steps run on the current count; after FIRST_PROBE_AFTER steps, then every `every`, a
  probe alternates the current count and the other candidate step by step (`probe` steps
  each, so that the batch and the machine change alike for both), comparing the median
  seconds per token fed (a step's tokens vary);
- the other count is taken when its median is at least `margin` faster (hysteresis: noise
  between two near-equal counts does not flip the choice every probe);
- the candidates are the automatic count and half of it (1 on a 2-core machine), and the probe
  keeps trying the one not in use, so a server that dropped to half returns when the other
  process ends.

A probe costs at most `probe` steps at the slower count per `every` steps (0.78% of the steps
with the defaults, and less time than that when the two are close). Only where the count is
automatic: `--threads N` or OMP_NUM_THREADS set by the user is kept as given.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

EVERY_STEPS = 1024
"""Steps between probes: at a 2-core CPU decode step of 5-50 ms, every 5-50 s."""
FIRST_PROBE_AFTER = 64
"""Steps before the first probe: a server started beside a busy process finds out in its
first second or two, not after EVERY_STEPS."""
PROBE_STEPS = 8
"""Steps per count in a probe (alternated): enough for a median over a moving batch."""
MARGIN = 0.1
"""How much faster (seconds per token) the other count must be to be taken."""


@dataclass
class ThreadTuner:
    most: int
    """The automatic count (threads.py): the largest candidate."""
    every: int = EVERY_STEPS
    probe: int = PROBE_STEPS
    margin: float = MARGIN
    current: int = 0
    """The count the steps run on between probes (0: `most`, set in __post_init__)."""
    switches: list[tuple[int, int, float]] = field(default_factory=list)
    """(from, to, the other's seconds per token over the current's) for each change, oldest first."""
    _steps: int = 0
    _probe: dict[int, list[float]] = field(default_factory=dict)
    _planned: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.most < 1 or self.every < 2 * self.probe or self.probe < 1 or not 0 <= self.margin < 1:
            raise ValueError(f"ThreadTuner needs most >= 1, every >= 2 * probe >= 2, 0 <= margin < 1: got {self}")
        self.current = self.current or self.most
        self._steps = self.every - min(self.every, FIRST_PROBE_AFTER)

    @property
    def candidates(self) -> tuple[int, ...]:
        return tuple(sorted({self.most, max(1, self.most // 2)}, reverse=True))

    @property
    def other(self) -> int:
        return next(count for count in self.candidates if count != self.current)

    def next_threads(self) -> int:
        """The count the next step runs on."""
        if len(self.candidates) == 1:
            return self.current
        if not self._planned and self._steps >= self.every:  # a probe starts: current, other, other, current, ...
            pair = (self.current, self.other)
            self._planned = [pair[(step + step // 2) % 2] for step in range(2 * self.probe)]
            self._probe = {count: [] for count in pair}
            self._steps = 0
        return self._planned[0] if self._planned else self.current

    def observe(self, seconds: float, tokens: int) -> None:
        """The step just run (on `next_threads()`'s count) took `seconds` for `tokens` fed."""
        if not self._planned:
            self._steps += 1
            return
        count = self._planned.pop(0)
        if tokens > 0:
            self._probe[count].append(seconds / tokens)
        if not self._planned:
            self._decide()

    def _decide(self) -> None:
        mine, theirs = self._probe.get(self.current), self._probe.get(self.other)
        if not mine or not theirs:  # steps without tokens: nothing to compare
            return
        ratio = statistics.median(theirs) / statistics.median(mine)
        if ratio <= 1 - self.margin:
            self.switches.append((self.current, self.other, ratio))
            self.current = self.other
