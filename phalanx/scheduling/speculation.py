"""Speculative decoding: which tokens a sequence's next step guesses, as plain data (torch-free:
the scheduler asks for them), by prompt lookup (n-gram) or from a draft the engine made.

A decoding sequence whose last `n` tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) appeared earlier in its prompt or output guesses that what followed them
then follows them again: up to `num_speculative_tokens` tokens. The step feeds the last token
and the guesses together; the engine keeps the guesses the model itself would have drawn, in
order, and the model's own token after the last one kept (`serve/speculative.py`). Text that
repeats its context (code edits, quoting, summaries, extraction) gains several tokens a step;
text that does not costs the guessed positions' compute only. vLLM names the same method
`"ngram"` in `--speculative-config`, with the same three fields.

With `"deepseek_mtp"` (vLLM's name; `"mtp"` too) the guess is the one DeepSeek-V3's own
multi-token-prediction layer drafted after the sequence's last step (`serve/mtp_draft.py`):
the engine leaves it on the sequence (`Sequence.drafted`), and the next step feeds it as the
n-gram guesses are fed and keeps it by the same rule. Beyond the first token the layer is
applied again on its own output (as vLLM does), so a longer draft is kept less often.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from phalanx.errors import UserError


NGRAM, MTP = "ngram", "deepseek_mtp"
METHODS = {"ngram": NGRAM, "deepseek_mtp": MTP, "mtp": MTP}
"""--speculative-config's methods, by the names vLLM accepts for them."""


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
    """No guesses while more sequences than this run or wait (vLLM's field): a full batch is
    compute-bound, and guessed positions then cost what they might save."""
    method: str = NGRAM
    """NGRAM (prompt lookup) or MTP (the model's multi-token-prediction layer drafts)."""

    @property
    def drafts_with_model(self) -> bool:
        """Whether the engine runs a draft model after every step (MTP)."""
        return self.method == MTP

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
        given = fields.pop("method", NGRAM)
        method = METHODS.get(given) if isinstance(given, str) else None
        if method is None:
            raise UserError(f"--speculative-config: method {given!r} is not "
                            "supported; phalanx serve has \"ngram\" (prompt lookup) and \"deepseek_mtp\" (DeepSeek-V3's "
                            "multi-token-prediction layer)")
        known = {"num_speculative_tokens", "disable_by_batch_size"}
        if method == NGRAM:
            known |= {"prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UserError(f"--speculative-config: unknown field(s) {', '.join(unknown)}; known: method, "
                            f"{', '.join(sorted(known))}")
        if "num_speculative_tokens" not in fields:
            raise UserError("--speculative-config needs num_speculative_tokens (how many tokens a step guesses)")
        for name, value in fields.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"--speculative-config: {name} must be a whole number >= 1, got {value!r}")
        config = cls(**fields, method=method)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise UserError(f"--speculative-config: prompt_lookup_min {config.prompt_lookup_min} is above "
                            f"prompt_lookup_max {config.prompt_lookup_max}")
        return config

    def propose(self, tokens: list[int], most: int, drafted: tuple[int, ...] = ()) -> list[int]:
        """At most `most` (and num_speculative_tokens) guessed next tokens of `tokens`: with MTP
        the draft made after them (`drafted`), else what followed the latest earlier occurrence
        of its longest repeated suffix (empty: none)."""
        most = min(most, self.num_speculative_tokens)
        if most <= 0:
            return []
        if self.method == MTP:
            return list(drafted[:most])
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
