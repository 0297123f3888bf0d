"""Byte-level tokenizer: token i is byte i, so any file is data and the vocabulary is 256."""

from __future__ import annotations

import numpy as np

VOCAB_SIZE = 256


def encode(text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8)


def decode(tokens) -> str:
    """Bytes back to text; invalid UTF-8 (a model can emit half a character) is replaced."""
    return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")
