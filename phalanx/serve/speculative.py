"""The engine's half of speculative decoding (the guesses come from `scheduling/speculation.py`):
which of a chunk's guessed tokens are kept, and the model's token after them.

A chunk with guesses g1..gk read the logits after its last token and after each guess. The
token after the last token is drawn as always (t1); g1 is kept if t1 == g1, and then t2 is
drawn from the logits after g1; and so on, until a draw differs from its guess (that draw is
the step's last token) or every guess is kept (the draw after gk is one more). Every draw is
the request's own (its settings, its generator in order, its penalties over the tokens so
far), so the tokens are those that decoding one token a step would give: greedy rows the same
ids, seeded rows the same ids as unguessed decoding of the same seed, and a draw that matches
its guess with the probability the model gives it, which is the rejection rule of
speculative sampling when the proposal is a single token (Leviathan et al., 2023).
"""

from __future__ import annotations

import torch

from phalanx.inference.sampling import Row, sample
from phalanx.scheduling.scheduler import Chunk


def kept_and_next(logits: torch.Tensor, chunk: Chunk, first: int, rows: list[int], params, generator) -> list[int]:
    """The chunk's new tokens: the guesses kept, then the model's next; `first`: the token
    drawn after its last token, `rows`: the rows of `logits` after each guess, `params`: its
    request's SamplingParams."""
    seq, new = chunk.seq, [first]
    for guess, row in zip(chunk.guesses, rows):
        if new[-1] != guess or new[-1] in seq.eos_ids:
            break
        output = seq.output + new
        banned = seq.eos_ids if len(output) < params.min_tokens else frozenset()
        new.append(sample(logits[row][None], [Row(params.sampling, generator, seq.prompt, output, banned)])[0])
    return new
