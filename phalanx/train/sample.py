"""Text generation from the trained model, for the end-of-run sample."""

from __future__ import annotations

import torch
from torch import nn

from phalanx.data.tokenizer import decode, encode


@torch.no_grad()
def generate(model: nn.Module, prompt: str, *, tokens: int, max_seq_len: int, device, seed: int = 0,
             temperature: float = 0.8, top_k: int = 40) -> str:
    """Sample `tokens` bytes after `prompt`. Every rank must call this (FSDP forwards are
    collective); the seeded generator makes all ranks draw the same tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(encode(prompt).tolist(), dtype=torch.long)[None].to(device)  # (1, seq)
    was_training = model.training
    model.eval()
    for _ in range(tokens):
        logits = model(ids[:, -max_seq_len:])  # (1, seq, vocab), vocab-sharded under tp
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        logits = logits[0, -1].float().cpu()  # (vocab,)
        values, choices = (logits / temperature).topk(top_k)
        pick = choices[torch.multinomial(values.softmax(-1), 1, generator=generator)]
        ids = torch.cat([ids, pick.to(device)[None]], dim=1)
    model.train(was_training)
    return decode(ids[0].tolist())
