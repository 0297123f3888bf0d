"""`phalanx serve --ttft-ms X --tpot-ms Y`: what the scheduler may do so that requests meet
their latency targets, decided from a step-time predictor (`slo_step_time.py`).

Every decoding sequence gets one token per step, so a step's time is the time between two of
its tokens: TPOT is met when no step takes longer than the target. So, per step:
- the prefill chunk is the most prompt tokens whose step, with this step's decodes, the
  predictor expects within the TPOT target (`prefill_budget`; with nothing decoding, nobody's
  TPOT is at stake and the whole `--max-num-batched-tokens` is used);
- a waiting request joins the running batch only if the decode step with it added is still
  expected within the target (`may_join`): the batch is as large as the target allows.
And when a request arrives, its TTFT is estimated from the prompt tokens queued ahead of it and
the prefill rate those chunks give (`check_admission`); beyond the TTFT target it is refused at
once (HTTP 429, `ttft_target_unattainable`) instead of queueing and making everyone late.

`HEADROOM` of the target is planned for, since a prediction is a mean and steps vary.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.scheduling.slo_step_time import OnlineStepFit, StepShape, StepTimePredictor, step_shape

HEADROOM = 0.85


@dataclass(frozen=True)
class QueueShape:
    """What a new request would queue behind (`Scheduler.queue_shape`)."""
    decodes: int
    """Running sequences past their prompt."""
    context_tokens: int
    """Their tokens so far."""
    prefill_tokens: tuple[int, ...] = ()
    """Prompt tokens each sequence ahead still has to feed, in the order they will."""

    def plus(self, prompts: list[int]) -> QueueShape:
        return QueueShape(self.decodes, self.context_tokens, self.prefill_tokens + tuple(prompts))


class SloUnattainable(Exception):
    """A request would not get its first token within the TTFT target (the API answers 429)."""


@dataclass(frozen=True)
class SloTargets:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        """Whether a finished request met every target set (TPOT: mean time per token after
        the first; None for a request of one token)."""
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s


class SloPolicy:
    def __init__(self, targets: SloTargets, max_num_batched_tokens: int, predictor: StepTimePredictor | None = None):
        self.targets = targets
        self.max_tokens = max_num_batched_tokens
        self.predictor: StepTimePredictor = predictor or OnlineStepFit()
        self.last_prefill_budget = max_num_batched_tokens
        """The prefill chunk last chosen for a step with decodes to protect (shown in /metrics)."""
        self.rejected = 0

    @property
    def step_limit_s(self) -> float | None:
        return None if self.targets.tpot_s is None else self.targets.tpot_s * HEADROOM

    def prefill_budget(self, decodes: int, context_tokens: int, budget: int) -> int:
        """The most prompt tokens (<= `budget`) a step with these decodes may add."""
        chunk = self._chunk(decodes, context_tokens, budget)
        if decodes and self.step_limit_s is not None:
            self.last_prefill_budget = chunk
        return chunk

    def _chunk(self, decodes: int, context_tokens: int, budget: int) -> int:
        limit = self.step_limit_s
        if limit is None or decodes == 0:
            return budget
        low, high = 0, budget  # the largest p with predict(p) <= limit, by bisection (any monotone predictor)
        while low < high:
            middle = (low + high + 1) // 2
            if self.predictor.predict(StepShape(decodes, middle, context_tokens + middle)) <= limit:
                low = middle
            else:
                high = middle - 1
        return low

    def may_join(self, running_tokens: list[int], joining_tokens: int) -> bool:
        """Whether a sequence of `joining_tokens` may join sequences of these lengths: the decode
        step of them all is expected within the TPOT target. The first always may."""
        limit = self.step_limit_s
        if limit is None or not running_tokens:
            return True
        shape = StepShape(len(running_tokens) + 1, 0, sum(running_tokens) + joining_tokens)
        return self.predictor.predict(shape) <= limit

    def ttft_estimate(self, queue: QueueShape, prompt_tokens: int) -> float:
        """Seconds until a prompt's first token, behind what is queued: the steps that prefill
        the prompts ahead of it, then its own, simulated with this policy's chunks, where
        each prompt once through decodes in every later step (so chunks shrink as the batch
        grows; nobody is assumed to finish within the horizon, which errs on the late side)."""
        decodes, context = queue.decodes, queue.context_tokens
        ahead = list(queue.prefill_tokens) + [prompt_tokens]
        elapsed, limit = 0.0, self.targets.ttft_s or float("inf")
        while ahead and elapsed <= limit:
            left = chunk = max(1, self._chunk(decodes, context, self.max_tokens))
            step_decodes = decodes
            while left and ahead:
                fed = min(left, ahead[0])
                ahead[0] -= fed
                left -= fed
                if ahead[0] == 0:
                    ahead.pop(0)
                    decodes += 1
            elapsed += self.predictor.predict(StepShape(step_decodes, chunk - left, context + chunk - left))
            context += chunk - left + step_decodes
        return elapsed

    def check_admission(self, queue: QueueShape, prompt_tokens: int) -> None:
        """SloUnattainable when the TTFT estimate is beyond the target."""
        if self.targets.ttft_s is None:
            return
        estimate = self.ttft_estimate(queue, prompt_tokens)
        if estimate > self.targets.ttft_s:
            self.rejected += 1
            raise SloUnattainable(
                f"this request would wait about {estimate * 1000:.0f} ms or more for its first token "
                f"({sum(queue.prefill_tokens)} prompt tokens are queued ahead of it), beyond this server's TTFT target "
                f"of {self.targets.ttft_s * 1000:g} ms (--ttft-ms); try again later")

    def observe(self, step, seconds: float) -> None:
        """A scheduled step ran in `seconds` (measured by the engine loop)."""
        if step is not None and step.chunks:
            self.predictor.observe(step_shape(step), seconds)
