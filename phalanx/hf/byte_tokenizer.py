"""A `tokenizer.json` for phalanx's byte tokenizer (token i is byte i), so that an exported
byte-level model comes with a tokenizer `transformers` and `tokenizers` can use.

Byte-level BPE with the 256-byte alphabet and no merges: the byte-to-character map is GPT-2's
(`tokenizers.pre_tokenizers.ByteLevel.alphabet()` is the same set), and each character's id
is its byte, so encoding gives the bytes and decoding turns them back into text.
"""

from __future__ import annotations

import json
from pathlib import Path


def _byte_characters() -> dict[int, str]:
    """GPT-2's map: printable bytes stand for themselves, the others for 256 + n, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def write_byte_tokenizer(folder: Path) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json for byte ids into `folder`."""
    # Imported when run, not at the top: it brings in tokenizers, which start-up need not wait for.
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {char: byte for byte, char in _byte_characters().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000}) + "\n")
    return [folder / "tokenizer.json", config]
