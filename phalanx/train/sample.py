"""Text generation from the trained model, for the end-of-run sample."""

from __future__ import annotations

import torch
from torch import nn

from phalanx.data.tokenizer import ByteTokenizer


@torch.no_grad()
def generate(model: nn.Module, prompt: str, *, tokens: int, max_seq_len: int, device, seed: int = 0,
             temperature: float = 0.8, top_k: int = 40, pad_to: int = 1, next_logits=None, tokenizer=None) -> str:
    """Sample `tokens` tokens after `prompt`. Every rank must call this (FSDP forwards are
    collective); the seeded generator makes all ranks draw the same tokens.

    `pad_to`: sequence parallelism splits the sequence evenly over tp ranks, so the context is
    padded on the right to a multiple of it; with causal attention the padding cannot change
    the logits at the last real position, which are the ones read.

    `next_logits(ids, position)`: how to get the logits at `position` when the model is not
    one callable module (a pipeline stage's rank); default: call `model`.

    `tokenizer`: the run's (default: bytes)."""
    tokenizer = tokenizer or ByteTokenizer()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(tokenizer.encode(prompt).tolist(), dtype=torch.long)[None].to(device)  # (1, seq)
    was_training = model.training
    model.eval()
    for _ in range(tokens):
        context = ids[:, -max_seq_len:]  # (1, seq)
        seq = context.shape[1]
        padded = torch.nn.functional.pad(context, (0, -seq % pad_to))  # (1, seq rounded up)
        if next_logits is not None:
            logits = next_logits(padded, seq - 1).float().cpu()  # (vocab,)
        else:
            logits = model(padded)  # (1, padded seq, vocab), vocab-sharded under tp
            if hasattr(logits, "full_tensor"):
                logits = logits.full_tensor()
            logits = logits[0, seq - 1].float().cpu()  # (vocab,)
        values, choices = (logits / temperature).topk(top_k)
        pick = choices[torch.multinomial(values.softmax(-1), 1, generator=generator)]
        ids = torch.cat([ids, pick.to(device)[None]], dim=1)
    model.train(was_training)
    return tokenizer.decode(ids[0].tolist())
