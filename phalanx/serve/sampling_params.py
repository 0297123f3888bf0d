"""How a request's tokens are picked (`SamplingParams`, part of its frozen Request) and where a
sequence stands in picking them (`Draws`, part of its Sequence's state): the request/state
split of sampling. The draws themselves are `step_sampler.py`'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from phalanx.inference.grammar import Matcher
from phalanx.inference.sampling import Sampling


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are picked, as it asked (a Request's `params`; vLLM's
    SamplingParams): `sampling` is `phalanx generate`'s, its seed included."""
    sampling: Sampling
    logprobs: int | None = None
    """Also return the sampled token's log-probability and this many top alternatives."""
    min_tokens: int = 0
    """Until this many tokens are out, its ends of sequence (the request's `eos_ids`) are banned."""


GREEDY = SamplingParams(Sampling(greedy=True))
"""A request that says nothing of sampling."""


@dataclass
class Draws:
    """A sequence's state of sampling (its Sequence's `draws`): its own generator, seeded from
    its request's seed at its first draw, and under structured output its place in its grammar,
    advanced by each token it takes (the sequence ends, "stop", when the grammar is terminated)."""
    generator: torch.Generator | None = None
    grammar: Matcher | None = None


def request_sampling(temperature: float, top_p: float, top_k: int | None, seed: int | None,
                     logprobs: int | None = None) -> SamplingParams:
    """OpenAI's basic fields as a request's sampling: temperature 0 is greedy."""
    return seeded(openai_sampling(temperature=temperature, top_p=top_p, top_k=top_k), seed, logprobs)


def openai_sampling(*, temperature: float, top_p: float = 1.0, top_k: int | None = None, **fields) -> Sampling:
    """A `Sampling` from OpenAI's and vLLM's field values: temperature 0 is greedy, top_k
    None no cut; `fields`: the others by their `Sampling` names (min_p, penalties, logit_bias)."""
    return Sampling(greedy=temperature == 0, temperature=temperature or 1.0, top_k=top_k or 0, top_p=top_p, **fields)


def seeded(sampling: Sampling, seed: int | None, logprobs: int | None = None, min_tokens: int = 0) -> SamplingParams:
    """`sampling` with `seed` (None: a random one) as a request's."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    return SamplingParams(dataclasses.replace(sampling, seed=seed), logprobs, min_tokens)
