"""What structured output costs per token: xgrammar's mask of a JSON schema (phalanx/inference/grammar.py)
filled and applied for 1 and 32 rows over a vocabulary of Qwen's size, and the schema's compile time.

The vocabulary is made up (every byte, then random words of 2-8 ASCII letters, digits and JSON's
punctuation, up to 151,936 tokens, three special tokens at the end), so that it runs with
nothing downloaded; a real byte-level BPE vocabulary has the same size and the same kind of
tokens. The answer is fed one byte token at a time (the most steps a text can take).

    .venv/bin/python benchmarks/grammar_mask.py
"""

from __future__ import annotations

import json
import random
import time

import torch
import xgrammar

VOCAB = 151_936
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engine", "poetry"]}


def vocabulary() -> list[bytes]:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]\":,.-_"
    words = [bytes([i]) for i in range(256)]
    seen = set(words)
    while len(words) < VOCAB - 3:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8))).encode()
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words + [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>"]


def main() -> None:
    words = vocabulary()
    info = xgrammar.TokenizerInfo(words, xgrammar.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[VOCAB - 3, VOCAB - 1])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    print(f"compile the schema: {(time.perf_counter() - start) * 1e3:.1f} ms")
    start = time.perf_counter()
    compiler.compile_regex(r"[a-z]{3}-\d{2,4}")
    print(f"compile a regex: {(time.perf_counter() - start) * 1e3:.1f} ms")
    tokens = list(json.dumps(ANSWER, separators=(", ", ": ")).encode())  # byte i is token i
    for rows in (1, 32):
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]
        logits = torch.randn(rows, VOCAB)
        fill = apply = 0.0
        for token in tokens:
            bitmask = xgrammar.allocate_token_bitmask(rows, VOCAB)
            start = time.perf_counter()
            for row, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, row)
            filled = time.perf_counter()
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=list(range(rows)))
            fill, apply = fill + filled - start, apply + time.perf_counter() - filled
            for matcher in matchers:
                assert matcher.accept_token(token)
        steps = len(tokens)
        print(f"{rows:2d} rows: fill {fill / steps * 1e3:.2f} ms a step ({fill / steps / rows * 1e3:.3f} ms a row), "
              f"apply {apply / steps * 1e3:.2f} ms a step ({apply / steps / rows * 1e3:.3f} ms a row), {steps} steps")


if __name__ == "__main__":
    main()
