"""The JSON of OpenAI's answers: completion and chat objects, their streamed chunks, usage and
log-probabilities, built from the pieces the engine thread hands over (engine_loop.Piece)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from phalanx.serve.api_requests import Generation


@dataclass
class Answer:
    """One request's answer as it grows."""
    gen: Generation
    model: str
    prompt: list[int]
    token_text: Callable[[int], str]
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_ids_sent: bool = False
    unsent_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.gen.chat else "cmpl-") + uuid.uuid4().hex

    def add(self, piece) -> None:
        self.text += piece.text
        if piece.token is not None:
            self.tokens.append(piece.token)
            if piece.logprob is not None:
                self.logprobs.append((piece.token, piece.logprob, piece.top_logprobs or []))
        self.finish_reason = piece.finish_reason or self.finish_reason

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.tokens),
                "total_tokens": len(self.prompt) + len(self.tokens)}

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
                "top_logprobs": [{self.token_text(i): v for i, v in top} for _, _, top in entries], "text_offset": offsets}

    def _choice(self, text: str, entries, offset: int, finish_reason, first: bool = False) -> dict:
        if self.gen.chat:
            delta_or_message = {"role": "assistant", "content": text} if first or not self.gen.stream else {"content": text}
            choice = {"index": 0, ("delta" if self.gen.stream else "message"): delta_or_message}
        else:
            choice = {"index": 0, "text": text}
        choice["logprobs"] = self._logprobs(entries, offset)
        choice["finish_reason"] = finish_reason
        return choice

    def final(self) -> dict:
        choice = self._choice(self.text, self.logprobs, 0, self.finish_reason)
        if self.gen.return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = list(self.prompt), list(self.tokens)
        return {"id": self.id, "object": "chat.completion" if self.gen.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.gen.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.gen.include_usage:
            body["usage"] = usage
        return sse(body)

    def first_chunk(self) -> str | None:
        """Chat streams open with the assistant's role and empty content, as OpenAI's do."""
        if not self.gen.chat:
            return None
        choice = self._choice("", [], 0, None, first=True)
        if self.gen.return_token_ids:
            choice["prompt_token_ids"] = list(self.prompt)
        return self.chunk([choice])

    def piece_chunk(self, piece, offset: int) -> str | None:
        """The chunk of one piece (None when it adds nothing to say: its token's text is held
        back, and its id goes out with the next chunk)."""
        entries = [(piece.token, piece.logprob, piece.top_logprobs or [])] if piece.logprob is not None else []
        if piece.token is not None:
            self.unsent_ids.append(piece.token)
        if not (piece.text or piece.finish_reason or entries):
            return None
        choice = self._choice(piece.text, entries, offset, piece.finish_reason)
        if self.gen.return_token_ids:
            choice["token_ids"], self.unsent_ids = self.unsent_ids, []
            if not self.gen.chat and not self.prompt_ids_sent:
                choice["prompt_token_ids"], self.prompt_ids_sent = list(self.prompt), True
        return self.chunk([choice])

    def usage_chunk(self) -> str | None:
        return self.chunk([], self.usage()) if self.gen.include_usage else None


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
