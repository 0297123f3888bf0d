"""What a client asked for, apart from what serving it has done so far.

A `Request` is fixed when it arrives (vLLM keeps the same split: the prompt and its
`SamplingParams` against the scheduler's state of a sequence): its prompt, how many tokens it
may have, which ids end it, how its tokens are picked, whether its prompt is scored. The
scheduler's `Sequence` holds a request and the state of serving it (tokens so far, blocks,
hashes, times); nothing in the scheduler or the engine changes a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    eos_ids: frozenset[int] = frozenset()
    params: Any = None
    """How its tokens are picked (`serve.engine.SamplingParams`; None: the engine's greedy)."""
    prompt_logprobs: int | None = None
    """Its prompt tokens' log-probabilities are wanted, with this many alternatives each (echo,
    prompt_logprobs): the whole prompt is computed (no prefix cache hit, as vLLM does), so that
    every position's logits exist to be read."""

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(self.prompt))  # a list given stays the caller's
