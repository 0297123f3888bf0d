"""A step's tokens from its logits: every sampling chunk's row drawn by the batch sampler that
`phalanx generate` also uses (`inference/sampling.py`: penalties, bias, top-k/top-p/min-p on the
step's rows at once, one seeded generator per request), the prompt scored where asked, the
grammars advanced, speculative guesses checked (`speculative.py`); then the scheduler closes
the step, and the new tokens come out as `TokenEvent`s.

Whatever one request's settings make the sampler do fails that request alone (`TokenEvent.error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from phalanx.inference.sampling import Row, sample, token_logprobs
from phalanx.scheduling.scheduler import Scheduler, Sequence, Step
from phalanx.serve.input_batch import Reads
from phalanx.serve.prompt_logprobs import PromptScore, PromptScores
from phalanx.serve.sampling_params import GREEDY, Draws, SamplingParams
from phalanx.serve.speculative import kept_and_next


@dataclass(frozen=True)
class TokenEvent:
    seq: Sequence
    token: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    """This request's sampling failed (it alone is ended; token is None)."""
    prompt_logprobs: list[PromptScore] | None = None
    """With the first token of a sequence that asked: its prompt tokens' scores (1 .. len - 1)."""


def _draws(seq: Sequence, params: SamplingParams) -> Draws:
    """The sequence's sampling state, started at its first draw."""
    if seq.draws is None:
        seq.draws = Draws()
    if seq.draws.generator is None:
        seq.draws.generator = params.sampling.generator()
    return seq.draws


class StepSampler:
    def __init__(self, on_logits: Callable[[Sequence, torch.Tensor], None] | None = None):
        """`on_logits(seq, logits)` sees the logits (vocab,) each token was picked from (tests)."""
        self.on_logits = on_logits
        self.prompt_scores = PromptScores()

    def sample(self, scheduler: Scheduler, step: Step, logits: torch.Tensor, reads: Reads) -> list[TokenEvent]:
        """A token for each sampling chunk from its logits row (the batch sampler, every row at
        once but the seeded draws), prompt tokens scored where asked, then `scheduler` closes
        the step."""
        read = logits  # every row the step read, guesses' rows included
        if reads.prompt:
            self.prompt_scores.add(logits[reads.prompt_rows], reads.prompt)
        if reads.prompt or any(reads.guess_rows):
            logits = logits[reads.sample_rows]
        sampling_chunks = reads.chunks
        asked: list[SamplingParams] = [chunk.seq.request.params or GREEDY for chunk in sampling_chunks]
        draws = [_draws(chunk.seq, a) for chunk, a in zip(sampling_chunks, asked)]
        if self.on_logits is not None:
            for row, chunk in zip(logits, sampling_chunks):
                self.on_logits(chunk.seq, row)
        rows = [Row(a.sampling, d.generator, chunk.seq.prompt, chunk.seq.output,
                    chunk.seq.eos_ids if len(chunk.seq.output) < a.min_tokens else frozenset(), d.grammar)
                for a, d, chunk in zip(asked, draws, sampling_chunks)]
        tokens, errors = _sample_rows(logits, rows)
        ended = _advance_grammars(draws, tokens, errors)
        logprobs: list[float | None] = [None] * len(asked)
        tops: list[list[tuple[int, float]] | None] = [None] * len(asked)
        wanted = [index for index, a in enumerate(asked) if a.logprobs is not None and index not in errors]
        if wanted:
            chosen, best = token_logprobs(logits[wanted], [tokens[i] for i in wanted], [asked[i].logprobs for i in wanted])
            for index, logprob, top in zip(wanted, chosen, best):
                logprobs[index], tops[index] = logprob, top
        for index in errors:
            scheduler.abort(sampling_chunks[index].seq, "error")  # finish_step passes over it
        sampled: dict[int, int | list[int]] = {
            id(chunk.seq): token for chunk, token in zip(sampling_chunks, tokens) if token is not None}
        for index, guess_rows in enumerate(reads.guess_rows):
            if guess_rows and tokens[index] is not None:
                chunk = sampling_chunks[index]
                sampled[id(chunk.seq)] = kept_and_next(read, chunk, tokens[index], guess_rows, asked[index],
                                                       draws[index].generator)
        lengths = [len(chunk.seq.tokens) for chunk in sampling_chunks]
        finished = {id(seq) for seq in scheduler.finish_step(step, sampled)}
        for index in ended:  # the grammar is complete: the answer is too
            seq = sampling_chunks[index].seq
            if id(seq) not in finished and seq in scheduler.running:
                scheduler.finish(seq, "stop")
                finished.add(id(seq))
        events = []
        for index, (chunk, token, logprob, top) in enumerate(zip(sampling_chunks, tokens, logprobs, tops)):
            seq = chunk.seq
            new = [None] if token is None else seq.tokens[lengths[index]:]
            for place, kept in enumerate(new):  # one token, or with guesses the kept ones and the next
                first, last = place == 0, place == len(new) - 1
                events.append(TokenEvent(seq, kept, logprob if first else None, top if first else None,
                                         seq.finish_reason if last and id(seq) in finished else None,
                                         errors.get(index) if first else None,
                                         self.prompt_scores.take(seq) if first and lengths[index] == len(seq.prompt)
                                         and token is not None else None))
        self.prompt_scores.forget_finished()
        return events


def _advance_grammars(draws: list[Draws], tokens: list[int | None], errors: dict[int, str]) -> list[int]:
    """Each constrained row's grammar advanced by its new token; the rows whose grammar is now
    terminated. A token the grammar refuses (only when nothing was left to allow, e.g. its end
    banned by `min_tokens`) fails that request alone, as a sampling error does."""
    ended = []
    for index, (d, token) in enumerate(zip(draws, tokens)):
        if d.grammar is None or token is None:
            continue
        if not d.grammar.accept(token):
            tokens[index] = None
            errors[index] = (f"structured output: the grammar allows no token here (token {token} was the "
                             "likeliest left; is min_tokens longer than the grammar lets the answer be?)")
        elif d.grammar.terminated:
            ended.append(index)
    return ended


def _sample_rows(logits: torch.Tensor, rows: list[Row]) -> tuple[list[int | None], dict[int, str]]:
    """Every row's token from one batched draw; if the batch fails, row by row, so that what one
    request's settings make the sampler do fails that request alone (its token None, its error
    by row index)."""
    try:
        return sample(logits, rows), {}
    except (RuntimeError, ValueError):
        pass
    tokens: list[int | None] = []
    errors: dict[int, str] = {}
    for index, row in enumerate(rows):
        try:
            tokens.append(sample(logits[index:index + 1], [row])[0])
        except (RuntimeError, ValueError) as error:
            tokens.append(None)
            errors[index] = f"sampling failed for this request: {str(error).splitlines()[0]}"
    return tokens, errors
