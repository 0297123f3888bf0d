"""The text sample at the end of a training run, through `phalanx.generate` (the code behind
`phalanx generate`): a KV cache where the layout allows, today's sampling (temperature 0.8,
top-k 40) and the run's tokenizer."""

from __future__ import annotations

from torch import nn

from phalanx.data.tokenizer import ByteTokenizer
from phalanx.inference.decoding import generate_ids
from phalanx.inference.sampling import Sampling
from phalanx.parallel.compile import uncompiled


def generate(model: nn.Module, prompt: str, *, tokens: int, max_seq_len: int, device, seed: int = 0,
             temperature: float = 0.8, top_k: int = 40, pad_to: int = 1, next_logits=None, tokenizer=None) -> str:
    """The prompt followed by up to `tokens` sampled tokens, fewer if the model's context of
    `max_seq_len` positions would overflow. Every rank must call this (its forwards are
    collective); all ranks draw the same tokens. `pad_to` and `next_logits`: see
    `phalanx.inference.decoding` (sequence parallelism, pipeline stages). `tokenizer`: the
    run's (default: bytes)."""
    tokenizer = tokenizer or ByteTokenizer()
    prompt_ids = [int(t) for t in tokenizer.encode(prompt)]
    tokens = min(tokens, max_seq_len - len(prompt_ids))
    if tokens < 1 or not prompt_ids:
        return prompt
    with uncompiled():  # `--compile`: the growing cache would compile the blocks anew for each length
        result = generate_ids(model, prompt_ids, max_new_tokens=tokens, max_len=max_seq_len, device=device,
                              sampling=Sampling(temperature=temperature, top_k=top_k, seed=seed),
                              pad_to=pad_to, next_logits=next_logits)
    return tokenizer.decode(prompt_ids + result.new_ids)
