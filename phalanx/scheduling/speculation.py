"""Speculative decoding by prompt lookup (n-gram): which tokens a sequence's next step guesses,
as plain data (torch-free: the scheduler asks for them).

A decoding sequence whose last `n` tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) appeared earlier in its prompt or output guesses that what followed them
then follows them again: up to `num_speculative_tokens` tokens. The step feeds the last token
and the guesses together; the engine keeps the guesses the model itself would have drawn, in
order, and the model's own token after the last one kept (`serve/speculative.py`). Text that
repeats its context (code edits, quoting, summaries, extraction) gains several tokens a step;
text that does not costs the guessed positions' compute only. vLLM names the same method
`"ngram"` in `--speculative-config`, with the same three fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from phalanx.errors import UserError


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
    """No guesses while more sequences than this run or wait (vLLM's field): a full batch is
    compute-bound, and guessed positions then cost what they might save."""

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None:
        """`--speculative-config` (JSON, vLLM's form), or a UserError naming what is wrong."""
        if not text:
            return None
        try:
            fields = json.loads(text)
        except ValueError as error:
            raise UserError(f"--speculative-config is not JSON: {error}") from None
        if not isinstance(fields, dict):
            raise UserError("--speculative-config must be a JSON object, e.g. "
                            '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
        method = fields.pop("method", "ngram")
        if method != "ngram":
            raise UserError(f"--speculative-config: method {method!r} is not supported; phalanx serve has \"ngram\" "
                            "(prompt lookup)")
        known = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UserError(f"--speculative-config: unknown field(s) {', '.join(unknown)}; known: method, "
                            f"{', '.join(sorted(known))}")
        if "num_speculative_tokens" not in fields:
            raise UserError("--speculative-config needs num_speculative_tokens (how many tokens a step guesses)")
        for name, value in fields.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"--speculative-config: {name} must be a whole number >= 1, got {value!r}")
        config = cls(**fields)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise UserError(f"--speculative-config: prompt_lookup_min {config.prompt_lookup_min} is above "
                            f"prompt_lookup_max {config.prompt_lookup_max}")
        return config

    def propose(self, tokens: list[int], most: int) -> list[int]:
        """At most `most` (and num_speculative_tokens) guessed next tokens of `tokens`: what
        followed the latest earlier occurrence of its longest repeated suffix (empty: none)."""
        most = min(most, self.num_speculative_tokens)
        if most <= 0:
            return []
        for n in range(min(self.prompt_lookup_max, len(tokens) - 1), self.prompt_lookup_min - 1, -1):
            suffix = tokens[-n:]
            last = suffix[-1]
            # Latest first: an end position e (exclusive) of an earlier occurrence, e <= len - 1.
            end = len(tokens) - 1
            while end >= n:
                try:
                    end = _rindex(tokens, last, n - 1, end) + 1
                except ValueError:
                    break
                if tokens[end - n:end] == suffix:
                    return tokens[end:end + most]
                end -= 1
        return []


def _rindex(tokens: list[int], value: int, low: int, high: int) -> int:
    """The last index i in [low, high) with tokens[i] == value (ValueError: none)."""
    for index in range(high - 1, low - 1, -1):
        if tokens[index] == value:
            return index
    raise ValueError(value)
