"""The log-probabilities of a prompt's own tokens (`echo` with `logprobs`, vLLM's
`prompt_logprobs`): what lm-evaluation-harness and perplexity scripts read from a server.

Token p of the prompt (p >= 1) is scored by the logits at position p - 1: the engine reads
those positions' logits while the prompt is computed (`input_batch.step_forwards`), possibly over
several steps of a chunked prefill, and this keeps each position's score until the sequence's
first token is drawn, which carries them all out (`step_sampler.TokenEvent.prompt_logprobs`). The first
prompt token has no score (nothing comes before it), as OpenAI and vLLM answer null.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.inference.sampling import token_logprobs
from phalanx.scheduling.scheduler import Sequence


@dataclass(frozen=True)
class PromptScore:
    """One prompt token's score: its log-probability, its rank in the model's distribution
    (1: the most likely), and the most likely alternatives as (token, log-probability)."""
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class PromptScores:
    """Scores of the prompts being computed, by sequence, until their first token is drawn."""

    def __init__(self):
        self._by_seq: dict[int, tuple[Sequence, dict[int, PromptScore]]] = {}

    def add(self, logits: torch.Tensor, reads: list[tuple[Sequence, int]]) -> None:
        """`logits` (len(reads), vocab): row i is read at position `reads[i][1]` of sequence
        `reads[i][0]`, and scores the prompt token after it. A position computed again (after
        a preemption) is scored again, to the same value."""
        if not reads:
            return
        tokens = [seq.prompt[position + 1] for seq, position in reads]
        chosen, tops = token_logprobs(logits, tokens, [seq.prompt_logprobs for seq, _ in reads])
        index = torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]
        ranks = (logits.float() > logits.float().gather(1, index)).sum(1).add(1).tolist()
        for (seq, position), logprob, rank, top in zip(reads, chosen, ranks, tops):
            self._by_seq.setdefault(id(seq), (seq, {}))[1][position + 1] = PromptScore(logprob, rank, top)

    def take(self, seq: Sequence) -> list[PromptScore] | None:
        """The scores of prompt tokens 1 .. len - 1 of `seq`, in order (None unless asked for);
        forgotten here."""
        if seq.prompt_logprobs is None:
            return None
        _, scores = self._by_seq.pop(id(seq), (seq, {}))
        return [scores[p] for p in range(1, len(seq.prompt))]

    def forget_finished(self) -> None:
        """Drop the scores of sequences that ended before their first token (aborted)."""
        for key, (seq, _) in list(self._by_seq.items()):
            if seq.finish_reason is not None:
                del self._by_seq[key]
