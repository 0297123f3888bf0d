"""Small `tokenizer.json` files trained on the spot (tests and benchmarks cannot download one)."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = ("the quick brown fox jumps over a lazy dog while phalanx trains transformers on text data "
         "across many devices with pipelines tensors experts and shards").split()


def sample_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def train_bpe(path: Path, *, vocab_size: int, texts: list[str] | None = None, byte_alphabet: bool = False,
              end_token: str = "<|endoftext|>") -> Path:
    """A byte-level BPE saved at `path`. Without `byte_alphabet` the alphabet is only the
    characters of `texts`, so the vocabulary can stay below a byte model's 256; with it, all
    256 bytes are tokens and any text encodes."""
    # Imported when run, not at the top: it brings in tokenizers, which start-up need not wait for.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[end_token], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_alphabet else [],
    )
    tok.train_from_iterator(texts or [sample_text(200, seed) for seed in range(20)], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
