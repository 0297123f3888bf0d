"""Grammar-constrained decoding (structured output): a request's constraint (a JSON schema, any
JSON object, a regular expression, a list of choices, an EBNF grammar) compiled once for the
served tokenizer, a matcher per sequence advanced by each token it takes, and the masks of a
step's constrained rows applied to the batch's logits.

The library is xgrammar, the one vLLM and SGLang use by default. It compiles a grammar into
per-state token masks ahead of time, so at each step a matcher fills its row of one packed
bitmask (a bit per token, int32 words) and one call applies the whole step's rows on the
logits' device. Measured on this machine's CPU (`benchmarks/grammar_mask.py`), for a
151,936-token vocabulary (Qwen's size) and a JSON
schema of a string, an integer and an array: filling a row's mask 0.37-0.42 ms per token,
applying it 0.3 ms per row, compiling the schema 50 ms (0.1 ms when cached), a regular
expression 4 ms. It installs as a wheel with no compiler and ran at once, so llguidance (the
other choice of vLLM) was not needed.

Without free whitespace: a JSON answer is written compactly (", " and ": " between items),
since a model (a random one, or a weak one) allowed any whitespace can spend every token of
`max_tokens` on it, the failure vLLM's `disable_any_whitespace` exists for. So no JSON answer
has a control character (below U+0020) outside a string, and JSON allows none unescaped inside
one; xgrammar 0.2.9's rule for a string with `maxLength` lets them through (its class of
characters leaves out only the quote, the backslash, CR and LF, and `json.loads` then
refuses), so JSON constraints also mask every token holding one.

A sequence ends ("stop") when its grammar is terminated: the grammar is complete and the model
took one of the sequence's ends of sequence, which the mask allows only there. A sequence with
no end-of-sequence id (the byte tokenizer, or `ignore_eos`) ends as soon as its grammar can.

Torch-free at import: the request checks of the HTTP front import `Constraint` from here.
"""

from __future__ import annotations

import warnings

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
CACHE_SIZE = 256
"""Compiled grammars kept, most recently used first (a compiled JSON schema is tens of KB to a
few MB for a large vocabulary)."""
JSON_SEPARATORS = (", ", ": ")


class GrammarError(ValueError):
    """The constraint cannot be compiled (a bad schema, regex or grammar): the request's fault."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. `text` is the schema as JSON text, the regex, the
    choices as a JSON list, or the EBNF; `param` names the request field it came from (for the
    400 when it does not compile), and is no part of the cache key."""
    kind: str
    text: str
    param: str = field(default="", compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind {self.kind!r} is not one of {KINDS}")


@dataclass(frozen=True)
class Vocabulary:
    """The served tokenizer as the grammar library needs it: a tokenizer.json (None: the byte
    tokenizer, token i = byte i), the model's vocabulary size (the logits' width, which may
    exceed the tokenizer's) and the model's ends of sequence."""
    tokenizer_file: Path | None
    vocab_size: int
    eos_ids: frozenset[int]


class Grammars:
    """Compiles constraints for one vocabulary, keeping the compiled grammars by key. Thread
    safe: the server compiles in worker threads (`asyncio.to_thread`), off its event loop."""

    def __init__(self, vocabulary: Vocabulary, cache_size: int = CACHE_SIZE):
        self.vocabulary, self.cache_size = vocabulary, cache_size
        self._compiler = None
        self._json_words = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                # Imported when run, not at the top: xgrammar (with torch and transformers) is
                # needed only once a request asks for structured output.
                import xgrammar

                info = _tokenizer_info(self.vocabulary)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
                self._json_words = _without_control_characters(info, self.vocabulary.vocab_size)
            return self._compiler

    def compile(self, constraint: Constraint) -> "Compiled":
        """The compiled grammar of `constraint` (a GrammarError saying why it cannot be)."""
        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                return self._cache[constraint]
        grammar = _compile(self.compiler(), constraint)
        compiled = Compiled(grammar, self._json_words if constraint.kind in ("json_schema", "json_object") else None)
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: "Compiled", ends: frozenset[int]) -> "Matcher":
        return Matcher(compiled, ends)


@dataclass(frozen=True)
class Compiled:
    grammar: Any
    """xgrammar's CompiledGrammar."""
    allowed_words: Any = None
    """A (1, vocab / 32) int32 bitmask every mask of this grammar is and-ed with (JSON: no
    control characters), or None."""


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, compiled: Compiled, ends: frozenset[int]):
        # Imported when run, not at the top: see Grammars.compiler.
        import xgrammar

        self.allowed_words = compiled.allowed_words
        self.vocab_size = compiled.grammar.tokenizer_info.vocab_size
        if ends:
            self._matcher = xgrammar.GrammarMatcher(compiled.grammar, override_stop_tokens=sorted(ends))
        else:  # nothing can end the sequence but the grammar itself
            self._matcher = xgrammar.GrammarMatcher(compiled.grammar, terminate_without_stop_token=True)

    def accept(self, token: int) -> bool:
        """Advance by the sequence's new token; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and asks for nothing more: the sequence ends here."""
        return bool(self._matcher.is_terminated())

    def can_begin(self) -> bool:
        """Whether any token of the vocabulary can come first (a vocabulary that cannot write
        what the grammar asks for, say words that cannot spell `{`, allows none)."""
        # Imported when run, not at the top: see Grammars.compiler.
        import torch
        import xgrammar

        vocab = self.vocab_size
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        self.fill(bitmask, 0)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # (vocab / 32, 32), id = 32 i + j
        return bool(bits.flatten()[:vocab].any())

    def fill(self, bitmask, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self.allowed_words is not None:
            bitmask[row] &= self.allowed_words[0]


def apply_masks(logits, rows: list[int], matchers: list[Matcher]) -> None:
    """Set to -inf, in place, every token that `matchers[i]`'s grammar does not allow next in
    row `rows[i]` of `logits` (rows, vocab): one bitmask for the step, filled row by row on the
    CPU and applied in one call on the logits' device."""
    # Imported when run, not at the top: see Grammars.compiler.
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[-1])  # (rows, vocab / 32) int32
    for row, matcher in zip(rows, matchers):
        matcher.fill(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


def _tokenizer_info(vocabulary: Vocabulary):
    # Imported when run, not at the top: see Grammars.compiler.
    import xgrammar

    stops = sorted(vocabulary.eos_ids)
    if vocabulary.tokenizer_file is None:  # bytes: token i is byte i
        return xgrammar.TokenizerInfo([bytes([i]) for i in range(256)], xgrammar.VocabType.RAW,
                                      vocab_size=max(vocabulary.vocab_size, 256), stop_token_ids=stops)
    # Imported when run, not at the top: transformers' wrapper is how xgrammar reads a
    # tokenizer.json (its byte-level or byte-fallback vocabulary), and costs seconds to import.
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(vocabulary.tokenizer_file))
    # A tokenizer that names no end of text: xgrammar refuses an empty list but takes None (and
    # warns that it found none); the answer then ends where the grammar does (engine.py).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocabulary.vocab_size,
                                                       stop_token_ids=stops or None)


def _without_control_characters(info, vocab_size: int):
    """A (1, vocab / 32) bitmask of every token but those whose text holds a control character
    (a byte below 0x20)."""
    # Imported when run, not at the top: see Grammars.compiler.
    import xgrammar

    words = xgrammar.allocate_token_bitmask(1, vocab_size)  # every bit set
    for token, text in enumerate(info.decoded_vocab[:vocab_size]):
        if any(byte < 0x20 for byte in text):
            cleared = ~(1 << (token % 32)) & 0xFFFFFFFF  # the word as unsigned, then as int32
            words[0, token // 32] &= cleared - (1 << 32) if cleared >= 1 << 31 else cleared
    return words


def _compile(compiler, constraint: Constraint):
    try:
        if constraint.kind == "json_schema":
            return compiler.compile_json_schema(constraint.text, any_whitespace=False, separators=JSON_SEPARATORS)
        if constraint.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                separators=JSON_SEPARATORS)
        if constraint.kind == "regex":
            return compiler.compile_regex(constraint.text)
        if constraint.kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(constraint.text)))
        return compiler.compile_grammar(constraint.text)
    except RuntimeError as error:  # xgrammar's C++ side: "... error at position 4: The parenthesis is not closed."
        raise GrammarError(_reason(error)) from None


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose sentences are exactly `choices` (string literals with JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _reason(error: Exception) -> str:
    """xgrammar's message without its time stamp and C++ source position."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and ": " in text:  # "[07:18:58] /project/cpp/regex_converter.cc:94: Regex parsing error ..."
        text = text.split(": ", 1)[1]
    return text
