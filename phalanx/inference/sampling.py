"""How the next token of every row of a batch is chosen from its logits at the last position:
`phalanx generate` (a batch of one), the end-of-run sample and `phalanx serve` (a step's rows)
share this one module.

For each row, in this order (vLLM's `SamplingParams` semantics, `transformers`' rule for the
repetition penalty):
0. a row under a grammar (structured output, `grammar.py`) keeps only the tokens its grammar
   allows next: the step's constrained rows masked by one bitmask, on the logits' device;
1. tokens the row may not emit yet (`banned`: its end-of-sequence and stop ids before
   `min_tokens`) get -inf, unless its grammar allows nothing else (the grammar's end wins);
2. `logit_bias` is added to its tokens' logits;
3. penalties: `repetition_penalty` p divides a positive logit by p and multiplies a negative one
   by p, for every token of the prompt or the output so far; `frequency_penalty` subtracts
   f x (times the token was generated), `presence_penalty` subtracts r once if it was
   generated at all (both over generated tokens only);
4. greedy rows take the first maximum of what is left (as `torch.argmax` does, and
   `transformers`' greedy search);
5. the others divide by the temperature, keep the `top_k` largest logits, then the smallest set
   whose probabilities add up to `top_p`, then those whose probability is at least `min_p`
   times the largest, and draw from what is left with the row's own seeded generator.
Steps 0-5 run on the batch's tensors at once, on the logits' device; only the uniform number
of each draw is one call per row, since each request has its own generator (a seeded request
draws the same tokens whatever else shares its batch). Every rank of a layout holds the same full logits and the
same generator states, so all ranks draw the same tokens without communicating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from phalanx.errors import UserError
from phalanx.inference.grammar import Matcher, apply_masks
from phalanx.inference.sampling_bounds import (LOGIT_BIAS_RANGE, MAX_REPETITION_PENALTY, MIN_TEMPERATURE, MIN_TOP_P,
                                               PENALTY_RANGE)

@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How one request chooses its tokens (immutable; the scheduler's state of the sequence,
    its output so far, lives elsewhere)."""

    greedy: bool = False
    temperature: float = 0.8
    """Logits are divided by it before the softmax: < 1 sharpens, > 1 flattens."""
    top_k: int = 40
    """Draw only among the k most likely tokens (0: no cut; more than the vocabulary: all)."""
    top_p: float = 1.0
    """Then only among the most likely tokens whose probabilities add up to p (1.0: no cut)."""
    min_p: float = 0.0
    """Then only tokens at least min_p times as likely as the most likely (0: no cut)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, value added to its logit) pairs."""
    seed: int = 0

    def validate(self) -> "Sampling":
        """A UserError naming the setting out of its range (the flags of `phalanx generate`)."""
        if self.greedy:
            return self._validate_shared()
        if not self.temperature > 0:  # also catches NaN
            raise UserError(f"--temperature must be > 0 (got {self.temperature}); for the most likely token use --greedy")
        if self.temperature == float("inf"):
            raise UserError("--temperature must be a finite number (got inf); for a uniform draw use a large one, e.g. 1e6")
        if self.temperature < MIN_TEMPERATURE:
            raise UserError(f"--temperature must be at least {MIN_TEMPERATURE:g} (got {self.temperature}): below it "
                            "sampling is greedy decoding to float32 precision, and far below it the logits overflow; "
                            "for the most likely token use --greedy")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0 (0: no top-k cut), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_p < MIN_TOP_P:
            raise UserError(f"--top-p must be at least {MIN_TOP_P:g} (got {self.top_p}); for the most likely token use "
                            "--greedy")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"--min-p must be in [0, 1], got {self.min_p}")
        return self._validate_shared()

    def _validate_shared(self) -> "Sampling":
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not low <= value <= high:
                raise UserError(f"{name} must be in [{low:g}, {high:g}], got {value}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise UserError(f"repetition_penalty must be > 0 and <= {MAX_REPETITION_PENALTY:g}, got "
                            f"{self.repetition_penalty}")
        low, high = LOGIT_BIAS_RANGE
        for token, value in self.logit_bias:
            if not low <= value <= high:
                raise UserError(f"logit_bias of token {token} must be in [{low:g}, {high:g}], got {value}")
        return self

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


@dataclass
class Row:
    """One row of a batch: its settings and what they read."""
    sampling: Sampling
    generator: torch.Generator | None = None
    """Its own draws (None for greedy rows)."""
    prompt: Sequence[int] = ()
    """For the repetition penalty."""
    output: Sequence[int] = ()
    """The tokens generated so far: penalties."""
    banned: frozenset[int] = field(default_factory=frozenset)
    """Tokens it may not emit at this step (ends of sequence before `min_tokens`)."""
    grammar: Matcher | None = None
    """Its structured output's place in its grammar: only what that allows next is kept."""


def sample(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """The token of each row of `logits` (rows, vocab)."""
    logits = processed(logits.float(), rows)
    tokens = [0] * len(rows)
    greedy = [index for index, row in enumerate(rows) if row.sampling.greedy]
    if greedy:
        for index, token in zip(greedy, logits[greedy].argmax(-1).tolist()):
            tokens[index] = token
    drawn = [index for index, row in enumerate(rows) if not row.sampling.greedy]
    if drawn:
        for index, token in zip(drawn, _draw(logits[drawn], [rows[i] for i in drawn])):
            tokens[index] = token
    return tokens


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from one row of full-vocabulary logits (vocab,)."""
    return sample(logits[None], [Row(sampling, generator)])[0]


def processed(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Steps 0-3 of the module docstring on (rows, vocab) float logits: the logits the choice
    is made from (a new tensor where anything changed)."""
    vocab, device = logits.shape[-1], logits.device
    constrained = [index for index, row in enumerate(rows) if row.grammar is not None]
    banned = [(index, token) for index, row in enumerate(rows) for token in row.banned if 0 <= token < vocab]
    biased = [(index, token, value) for index, row in enumerate(rows) for token, value in row.sampling.logit_bias
              if 0 <= token < vocab]
    penalized = [index for index, row in enumerate(rows) if row.sampling.penalized]
    if not (constrained or banned or biased or penalized):
        return logits
    logits = logits.clone()
    if constrained:
        apply_masks(logits, constrained, [rows[i].grammar for i in constrained])
    if banned:
        allowed = logits[constrained] if constrained else None  # (constrained rows, vocab): a copy
        at = torch.tensor(banned, dtype=torch.long, device=device)  # (banned, 2): row, token
        logits[at[:, 0], at[:, 1]] = -math.inf
        if constrained:
            # A grammar that allows only an end here wins over min_tokens: the answer is complete.
            dead = (~torch.isfinite(logits[constrained]).any(-1)).nonzero().flatten().tolist()
            if dead:
                logits[[constrained[i] for i in dead]] = allowed[dead]
    if biased:
        at = torch.tensor([(r, t) for r, t, _ in biased], dtype=torch.long, device=device)
        values = torch.tensor([v for _, _, v in biased], dtype=logits.dtype, device=device)
        logits.index_put_((at[:, 0], at[:, 1]), values, accumulate=True)
    if penalized:
        logits[penalized] = _penalties(logits[penalized], [rows[i] for i in penalized])
    return logits


def _penalties(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Repetition, frequency and presence penalties on (rows, vocab) logits, every row at once."""
    counts = _token_counts([row.output for row in rows], logits.shape).to(logits.device)  # (rows, vocab)
    seen = counts > 0
    in_prompt = _token_counts([row.prompt for row in rows], logits.shape).to(logits.device) > 0
    column = lambda values: torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]  # noqa: E731
    repetition = column([row.sampling.repetition_penalty for row in rows])
    repeated = seen | in_prompt
    logits = torch.where(repeated, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - column([row.sampling.frequency_penalty for row in rows]) * counts
    return logits - column([row.sampling.presence_penalty for row in rows]) * seen


def _token_counts(lists: list[Sequence[int]], shape: torch.Size) -> torch.Tensor:
    """(rows, vocab) float counts of each row's token ids (ids outside the vocabulary ignored)."""
    width = max((len(ids) for ids in lists), default=0)
    counts = torch.zeros(shape, dtype=torch.float32)
    if width:
        ids = torch.zeros(len(lists), width, dtype=torch.long)  # (rows, longest list), padded with 0
        ones = torch.zeros(len(lists), width)
        for index, row in enumerate(lists):
            inside = [token for token in row if 0 <= token < shape[-1]]
            ids[index, :len(inside)] = torch.tensor(inside, dtype=torch.long)
            ones[index, :len(inside)] = 1.0
        counts.scatter_add_(1, ids, ones)
    return counts


def _draw(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """Step 5 for rows that draw: (rows, vocab) processed logits -> a token per row.

    Only rows that cut by top_k or top_p sort (what is left of their vocabulary, largest first);
    the others draw from the whole vocabulary in place. The draw is by inverse distribution:
    one uniform number per row from its generator, found in the row's cumulative
    probabilities, every row at once. A sort of every row and torch.multinomial per row (the
    way before) cost 8.6x to 30x as much at real vocabularies (benchmarks/sampling_draw.py)."""
    vocab = logits.shape[-1]
    temperature = torch.tensor([row.sampling.temperature for row in rows], dtype=logits.dtype, device=logits.device)
    scaled = logits / temperature[:, None]
    narrows = [0 < row.sampling.top_k < vocab or row.sampling.top_p < 1 for row in rows]
    cut = [index for index, narrow in enumerate(narrows) if narrow]
    whole = [index for index, narrow in enumerate(narrows) if not narrow]
    tokens = [0] * len(rows)
    if whole:
        probs = _min_p(scaled[whole].softmax(-1), [rows[i] for i in whole])
        for index, token in zip(whole, _inverse_draw(probs, [rows[i] for i in whole]).tolist()):
            tokens[index] = token
    if cut:
        probs, choices = _head(scaled[cut], [rows[i] for i in cut])
        picked = _inverse_draw(_min_p(probs, [rows[i] for i in cut]), [rows[i] for i in cut])
        for index, token in zip(cut, choices.gather(1, picked[:, None]).flatten().tolist()):
            tokens[index] = token
    return tokens


def _head(scaled: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' top_k and top_p cut: (probabilities, token ids), largest first, zero past a
    row's cut."""
    vocab = scaled.shape[-1]
    cuts = [vocab if row.sampling.top_k == 0 else min(row.sampling.top_k, vocab) for row in rows]
    values, choices = scaled.topk(max(cuts))  # (rows, k), largest first
    ranks = torch.arange(values.shape[-1], device=scaled.device)
    cut = torch.tensor(cuts, device=scaled.device)[:, None]
    values = values.masked_fill(ranks >= cut, -math.inf)  # a row's own top_k below the batch's widest
    probs = values.softmax(-1)
    top_p = torch.tensor([row.sampling.top_p for row in rows], dtype=probs.dtype, device=probs.device)[:, None]
    if bool((top_p < 1).any()):
        # Keep a token while the probability mass before it is below top_p (the first always).
        before = probs.cumsum(-1) - probs
        probs = torch.where((before < top_p) | (top_p >= 1), probs, torch.zeros_like(probs))
    return probs, choices


def _min_p(probs: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Zero where a token is less than min_p times as likely as the row's most likely."""
    min_p = torch.tensor([row.sampling.min_p for row in rows], dtype=probs.dtype, device=probs.device)[:, None]
    if not bool((min_p > 0).any()):
        return probs
    return torch.where(probs >= min_p * probs.amax(-1, keepdim=True), probs, torch.zeros_like(probs))


def _inverse_draw(probs: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """A column index per row of (rows, n) unnormalized probabilities: the first whose
    cumulative sum reaches u x the total, u in (0, 1] from the row's generator (so never a
    zero-probability index). The sum is in float64: over 151,936 float32 terms, float32's
    rounding would move the boundaries by more than the smallest probabilities."""
    totals = probs.cumsum(-1, dtype=torch.float64)
    if not bool((totals[:, -1] > 0).all() and torch.isfinite(totals[:, -1]).all()):  # NaN fails both
        raise RuntimeError("the probabilities to draw from are not finite and positive (the logits overflowed)")
    uniform = torch.cat([1 - torch.rand(1, dtype=torch.float64, generator=row.generator) for row in rows])
    targets = (uniform.to(totals.device) * totals[:, -1])[:, None]
    return torch.searchsorted(totals, targets).flatten().clamp_(max=probs.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-probabilities of the model's distribution (before penalties and temperature, as
    OpenAI and vLLM report them) for each row's chosen token, and its `tops[i]` most likely
    (token, log-probability) pairs; logits (rows, vocab)."""
    scores = torch.log_softmax(logits.float(), -1)
    index = torch.tensor(tokens, dtype=torch.long, device=scores.device)[:, None]
    chosen = scores.gather(1, index)[:, 0].tolist()
    widest = max(tops, default=0)
    if not widest:
        return chosen, [[] for _ in tokens]
    values, ids = scores.topk(widest)  # (rows, widest), largest first
    values, ids = values.tolist(), ids.tolist()
    return chosen, [list(zip(ids[row][:count], values[row][:count])) for row, count in enumerate(tops)]
