"""How the next token is chosen from the logits at the last position.

Greedy takes the first maximum (as `torch.argmax` does, and `transformers`' greedy search).
Otherwise: divide by the temperature, keep the `top_k` largest logits, then the smallest set
of those whose probabilities add up to `top_p`, and draw from what is left with a seeded
generator. Every rank holds the same full logits and the same generator state, so all ranks
draw the same token without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.errors import UserError


MIN_TEMPERATURE = 1e-6
"""Below this, logits a trained model tells apart (by 1e-5 and more) differ by more than
float32's softmax resolves, so the draw is the greedy choice; and divided by a small enough
temperature the logits pass float32's largest value (3.4e38), where the softmax turns to nan."""
MIN_TOP_P = 1.2e-38
"""float32's smallest normal number (torch.finfo(torch.float32).tiny): the probability mass is
compared with top_p in float32, where a smaller top_p rounds towards 0 and then keeps no token."""


@dataclass(frozen=True, kw_only=True)
class Sampling:
    greedy: bool = False
    temperature: float = 0.8
    """Logits are divided by it before the softmax: < 1 sharpens, > 1 flattens."""
    top_k: int = 40
    """Draw only among the k most likely tokens (0: no cut; more than the vocabulary: all)."""
    top_p: float = 1.0
    """Then only among the most likely tokens whose probabilities add up to p (1.0: no cut)."""
    seed: int = 0

    def validate(self) -> "Sampling":
        if self.greedy:
            return self
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
        if not MIN_TOP_P <= self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], at least {MIN_TOP_P:g} (float32's smallest normal number), "
                            f"got {self.top_p}")
        return self

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from full-vocabulary logits (vocab,), on the CPU."""
    if sampling.greedy:
        return int(logits.argmax())
    logits = logits.float() / sampling.temperature
    k = logits.numel() if sampling.top_k == 0 else min(sampling.top_k, logits.numel())
    values, choices = logits.topk(k)  # (k,), largest first
    probs = values.softmax(-1)
    if sampling.top_p < 1:
        # Keep a token while the probability mass before it is below top_p (the first always).
        before = probs.cumsum(-1) - probs
        probs = torch.where(before < sampling.top_p, probs, torch.zeros_like(probs))
    return int(choices[torch.multinomial(probs, 1, generator=generator)])
