"""The JSON of OpenAI's answers: completion and chat objects, their streamed chunks, usage and
log-probabilities, built from the pieces the engine thread hands over (engine_loop.Piece).

A request has one choice per prompt and per `n`, numbered as OpenAI numbers them: choice
`prompt_index * n + i`. Usage counts each prompt once and every answered choice's tokens.
Under `best_of` > n each prompt has best_of candidates, and the n of highest cumulative
log-probability are answered.

`echo` puts the prompt's text before each choice's text, and with `logprobs` the prompt's
tokens before its tokens (the first prompt token's log-probability and alternatives null, as
OpenAI and vLLM answer); streamed, both go out with the choice's first chunk.
`prompt_logprobs` (vLLM's) is a list beside it: null, then for each prompt token a map from
token id to its log-probability, rank and text, the prompt's token and its alternatives.

A forced tool call (`tool_choice` required or a named function; its text constrained to JSON by
the grammar) is answered as `message.tool_calls` with `finish_reason` "tool_calls"; streamed,
in one delta when the choice ends. A call cut short by `max_tokens` stays text ("length").
Under "auto" the calls are parsed from the model's own text in the server's format
(tool_call_parsers.py: Hermes' `<tool_call>`, Llama 3's JSON): streamed, the content goes out as
it comes, less what may be the start of a call, the calls when the choice ends.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from phalanx.serve.api_requests import Generation


@dataclass
class Choice:
    """One choice's answer as it grows."""
    index: int
    prompt: list[int]
    prompt_index: int = 0
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    sent_chars: int = 0
    """Characters of text streamed so far (completions' text_offset)."""
    prompt_ids_sent: bool = False
    unsent_ids: list[int] = field(default_factory=list)
    prompt_scores: list | None = None
    """Its prompt tokens' scores (prompt_logprobs.PromptScore), from its first piece, when asked."""
    echo_sent: bool = False
    cached_tokens: int = 0
    """Of its prompt, the tokens taken from the prefix cache."""
    held_entries: list = field(default_factory=list)
    """A streamed tool call's log-probability entries, sent with the call when it ends."""


@dataclass
class Answer:
    """One request's answer as it grows: its choices."""
    gen: Generation
    model: str
    prompts: list[list[int]]
    token_text: Callable[[int], str]
    echoed: list[str] | None = None
    """`echo`: each prompt's text."""
    tool_parser: object = None
    """Under tool_choice "auto": the module of tool_call_parsers.PARSERS that reads the calls."""
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.gen.chat else "cmpl-") + uuid.uuid4().hex
        self.choices = [Choice(p * self.gen.best_of + i, prompt, p) for p, prompt in enumerate(self.prompts)
                        for i in range(self.gen.best_of)]

    @property
    def finished(self) -> bool:
        return all(choice.finish_reason for choice in self.choices)

    def add(self, index: int, piece) -> None:
        choice = self.choices[index]
        choice.text += piece.text
        if piece.prompt_logprobs is not None:
            choice.prompt_scores = piece.prompt_logprobs
        if piece.token is not None:
            choice.tokens.append(piece.token)
            if piece.logprob is not None:
                choice.logprobs.append((piece.token, piece.logprob, piece.top_logprobs or []))
        choice.finish_reason = piece.finish_reason or choice.finish_reason
        choice.cached_tokens = piece.cached_tokens

    def answered(self) -> list[Choice]:
        """The choices answered: all, or under best_of > n each prompt's n candidates of highest
        cumulative log-probability (as vLLM ranks them), renumbered prompt_index * n + rank."""
        if self.gen.best_of == self.gen.n:
            return self.choices
        out = []
        for p in range(len(self.prompts)):
            candidates = self.choices[p * self.gen.best_of:(p + 1) * self.gen.best_of]
            best = sorted(candidates, key=lambda c: -sum(logprob for _, logprob, _ in c.logprobs))[:self.gen.n]
            out += [dataclasses.replace(c, index=p * self.gen.n + rank) for rank, c in enumerate(best)]
        return out

    def usage(self) -> dict:
        """Each prompt once and the answered choices' tokens (as vLLM counts under best_of)."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.tokens) for c in self.answered())
        # Each prompt's first choice: the others find its blocks in the cache (the prompt counts once).
        cached = sum(c.cached_tokens for c in self.choices[::self.gen.best_of])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _logprobs(self, entries, offset: int) -> dict | None:
        if self.gen.logprobs is None:
            return None
        if self.gen.chat:
            def one(token, logprob):
                text = self.token_text(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top in entries]}
        texts = [self.token_text(t) for t, _, _ in entries]
        offsets, at = [], offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if top is None else {self.token_text(i): v for i, v in top} for _, _, top in entries],
                "text_offset": offsets}

    def _echo(self, c: Choice) -> tuple[str, list]:
        """What `echo` puts first in choice `c`: the prompt's text, and its tokens' log-probability
        entries when log-probabilities are asked (empty without echo)."""
        if self.echoed is None:
            return "", []
        if self.gen.logprobs is None or c.prompt_scores is None:
            return self.echoed[c.prompt_index], []
        first = [(c.prompt[0], None, None)]  # nothing before it to score it by
        return self.echoed[c.prompt_index], first + [(token, score.logprob, score.top)
                                                           for token, score in zip(c.prompt[1:], c.prompt_scores)]

    def _prompt_logprobs(self, c: Choice) -> list | None:
        if c.prompt_scores is None or self.gen.prompt_logprobs is None:
            return None
        out: list = [None]
        for token, score in zip(c.prompt[1:], c.prompt_scores):
            ranked = {token: (score.logprob, score.rank)}
            for rank, (other, logprob) in enumerate(score.top[:self.gen.prompt_logprobs], 1):
                ranked.setdefault(other, (logprob, rank))
            out.append({str(t): {"logprob": lp, "rank": r, "decoded_token": self.token_text(t)}
                        for t, (lp, r) in ranked.items()})
        return out

    def _tool_calls(self, c: Choice) -> tuple[str | None, list[dict]] | None:
        """(content, OpenAI's tool calls) of a finished choice; None: it is not a tool call
        (text asked for, a forced call cut short, or auto's model wrote none)."""
        if not self.gen.chat or self.gen.tool_call is None or not c.finish_reason:
            return None
        if self.gen.tool_call == "auto":
            content, parsed = self.tool_parser.parse(c.text)
            calls = [(call.name, call.arguments) for call in parsed]
        else:
            if c.finish_reason != "stop":
                return None
            try:
                values = json.loads(c.text)
            except ValueError:
                return None
            if self.gen.tool_call == "named":
                values = [{"name": self.gen.tool_name, "parameters": values}]
            content, calls = None, [(v["name"], json.dumps(v["parameters"], ensure_ascii=False)) for v in values]
        if not calls:
            return None
        return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": name, "arguments": arguments}} for name, arguments in calls]

    def _choice(self, index: int, text: str, entries, offset: int, finish_reason, first: bool = False) -> dict:
        if self.gen.chat:
            delta_or_message = {"role": "assistant", "content": text} if first or not self.gen.stream else {"content": text}
            choice = {"index": index, ("delta" if self.gen.stream else "message"): delta_or_message}
        else:
            choice = {"index": index, "text": text}
        choice["logprobs"] = self._logprobs(entries, offset)
        choice["finish_reason"] = finish_reason
        return choice

    def final(self) -> dict:
        out = []
        for c in self.answered():
            echo_text, echo_entries = self._echo(c)
            choice = self._choice(c.index, echo_text + c.text, echo_entries + c.logprobs, 0, c.finish_reason)
            called = self._tool_calls(c)
            if called:
                choice["message"] = {"role": "assistant", "content": called[0], "tool_calls": called[1]}
                choice["finish_reason"] = "tool_calls"
            if self.gen.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(c)
            if self.gen.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = list(c.prompt), list(c.tokens)
            out.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.gen.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": self.usage()}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.gen.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.gen.include_usage:
            body["usage"] = usage
        return sse(body)

    def first_chunks(self) -> list[str]:
        """Chat streams open with the assistant's role and empty content for each choice, as
        OpenAI's do."""
        if not self.gen.chat:
            return []
        chunks = []
        for c in self.choices:
            choice = self._choice(c.index, "", [], 0, None, first=True)
            if self.gen.return_token_ids:
                choice["prompt_token_ids"] = list(c.prompt)
            chunks.append(self.chunk([choice]))
        return chunks

    def piece_chunk(self, index: int, piece) -> str | None:
        """The chunk of one piece of choice `index`, which it then adds (None when it adds
        nothing to say: its token's text is held back, and its id goes out with the next chunk)."""
        c = self.choices[index]
        entries = [(piece.token, piece.logprob, piece.top_logprobs or [])] if piece.logprob is not None else []
        if piece.token is not None:
            c.unsent_ids.append(piece.token)
        self.add(index, piece)
        if self.gen.chat and self.gen.tool_call is not None:
            return self._tool_call_chunk(c, entries, piece)
        text, first = piece.text, not c.echo_sent and (self.echoed is not None or self.gen.prompt_logprobs is not None)
        if first:  # the choice's first piece: what echo puts before it
            echo_text, echo_entries = self._echo(c)
            text, entries, c.echo_sent = echo_text + text, echo_entries + entries, True
        offset = c.sent_chars
        c.sent_chars += len(text)
        if not (text or piece.finish_reason or entries):
            return None
        choice = self._choice(c.index, text, entries, offset, piece.finish_reason)
        if first and self.gen.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(c)
        if self.gen.return_token_ids:
            choice["token_ids"], c.unsent_ids = c.unsent_ids, []
            if not self.gen.chat and not c.prompt_ids_sent:
                choice["prompt_token_ids"], c.prompt_ids_sent = list(c.prompt), True
        return self.chunk([choice])

    def last_chunks(self) -> list[str]:
        """After the last piece: the usage chunk when asked, then [DONE]."""
        return ([self.chunk([], self.usage())] if self.gen.include_usage else []) + [DONE]

    def error_chunk(self, error) -> str:
        """The stream's end when the engine ended the request with an error (api_requests.ApiError)."""
        return sse(error.body()) + DONE

    def _tool_call_chunk(self, c: Choice, entries, piece) -> str | None:
        """A streamed choice that may call tools: content as far as it cannot be the start of a
        call (auto; none for a forced call), the calls in one delta when it ends (or the rest of
        its text, if it made none)."""
        c.held_entries += entries
        if not piece.finish_reason:
            end = self.tool_parser.sendable(c.text) if self.gen.tool_call == "auto" else 0
            if end <= c.sent_chars:
                return None
            text, c.sent_chars = c.text[c.sent_chars:end], end
            choice = self._choice(c.index, text, c.held_entries, 0, None)
            c.held_entries = []
            return self.chunk([choice])
        called = self._tool_calls(c)
        if not called:
            choice = self._choice(c.index, c.text[c.sent_chars:], c.held_entries, 0, piece.finish_reason)
        else:
            choice = self._choice(c.index, "", c.held_entries, 0, "tool_calls")
            content = c.text[c.sent_chars:self.tool_parser.sendable(c.text)] if self.gen.tool_call == "auto" else ""
            choice["delta"] = {"tool_calls": [{"index": i, **call} for i, call in enumerate(called[1])]}
            if content:
                choice["delta"]["content"] = content
        c.sent_chars = len(c.text)
        if self.gen.return_token_ids:
            choice["token_ids"], c.unsent_ids = c.unsent_ids, []
        return self.chunk([choice])


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
