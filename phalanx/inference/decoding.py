"""Generation: prefill the prompt once, then one token per step through a KV cache.

The model is the training code's own `Transformer`, in whatever layout it was parallelized
(one process, or tensor parallel: each rank caches the keys and values of its own heads, and
the vocabulary-sharded logits of the last position are gathered with `full_tensor()`).

Two cases recompute the whole context at every step instead of caching:
- a model that is not one callable module (a pipeline stage's rank), through `next_logits`;
- sequence parallelism (`pad_to` > 1), which splits the sequence evenly over the tp ranks: a
  one-token step cannot be split, and padding it would put pad keys into the cache. The
  context is padded on the right to a multiple of `pad_to`; with causal attention the padding
  cannot change the logits at the last real position, which are the ones read.

The context is never longer than `max_len` (the model's positions): asking for more is an
error, not a silent sliding window. Generation stops after `max_new_tokens` tokens, or after
`eos_id` when the tokenizer has an end-of-text token (it is kept as the last new id).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from phalanx.errors import UserError
from phalanx.inference.sampling import Sampling, pick_token
from phalanx.model.kv_cache import KVCache


@dataclass
class Generated:
    new_ids: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    """Seconds from the prompt to the first new token (one forward over the whole prompt)."""
    decode_s: float = 0.0
    """Seconds of the steps after it, one token each."""

    @property
    def decode_tokens_per_s(self) -> float | None:
        steps = len(self.new_ids) - 1  # the first new token came from the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else None


def check_context(prompt_len: int, max_new_tokens: int, max_len: int) -> None:
    if prompt_len < 1:
        raise UserError("the prompt is empty; generation needs at least one token to start from")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > max_len:
        raise UserError(f"a prompt of {prompt_len} tokens + {max_new_tokens} new tokens = {prompt_len + max_new_tokens} "
                        f"positions exceeds the model's context of {max_len}")


def _last_logits(logits: torch.Tensor, position: int) -> torch.Tensor:
    """Full-vocabulary logits (vocab,) on the CPU at `position` of (1, seq, vocab) logits,
    which are a vocabulary-sharded DTensor under tensor parallelism."""
    row = logits[:, position]  # (1, vocab), still sharded over the vocabulary
    if hasattr(row, "full_tensor"):
        row = row.full_tensor()
    return row[0].float().cpu()


@torch.no_grad()
def generate_ids(model: nn.Module | None, prompt: list[int], *, max_new_tokens: int, max_len: int,
                 sampling: Sampling = Sampling(), device=None, eos_id: int | None = None, pad_to: int = 1,
                 next_logits: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                 use_cache: bool = True, on_logits: Callable[[torch.Tensor], None] | None = None) -> Generated:
    """New token ids after `prompt`. Every rank of the model's layout must call this with the
    same arguments (its forwards are collective).

    `next_logits(ids, position)`: the logits (vocab,) at `position` of ids (1, seq), for a model
    that is not one callable module; implies recomputing. `use_cache=False` recomputes the whole
    context each step too (the reference the cache is tested against). `on_logits` sees the
    logits each token was picked from (for tests)."""
    check_context(len(prompt), max_new_tokens, max_len)
    sampling.validate()
    generator = sampling.generator()
    recompute = next_logits is not None or pad_to > 1 or not use_cache
    cache = None if recompute else KVCache(len(prompt) + max_new_tokens)
    was_training = model.training if model is not None else False
    if model is not None:
        model.eval()
    ids = torch.tensor(prompt, dtype=torch.long, device=device)[None]  # (1, prompt)
    result = Generated()
    began = time.perf_counter()
    feed = ids  # what the next forward sees: the prompt, then one token (cache) or everything
    for step in range(max_new_tokens):
        if recompute:
            seq = ids.shape[1]
            padded = torch.nn.functional.pad(ids, (0, -seq % pad_to))  # (1, seq rounded up)
            if next_logits is not None:
                logits = next_logits(padded, seq - 1).float().cpu()  # (vocab,)
            else:
                logits = _last_logits(model(padded), seq - 1)
        else:
            logits = _last_logits(model(feed, cache, last_only=True), -1)  # (vocab,)
        if on_logits is not None:
            on_logits(logits)
        token = pick_token(logits, sampling, generator)  # reads the logits: waits for the device
        now = time.perf_counter()
        if step == 0:
            result.prefill_s = now - began
        else:
            result.decode_s += now - began
        began = now
        result.new_ids.append(token)
        if token == eos_id:
            break
        feed = torch.tensor([[token]], dtype=torch.long, device=ids.device)  # (1, 1)
        ids = torch.cat([ids, feed], dim=1)
    if model is not None:
        model.train(was_training)
    return result
