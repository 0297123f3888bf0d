"""OpenAI's Responses API (`POST /v1/responses`, the OpenAI SDK's newer default), without
stored state: a request is read as the chat completion of the same messages (`instructions` a
system message before `input`), and answered as a `response` object, or streamed as its typed
events (`response.created` ... `response.output_text.delta` ... `response.completed`).

Nothing is stored, so `previous_response_id`, `conversation`, `background` and `store: true`
are refused (a client that relies on them would silently lose its history otherwise); which
other fields are honoured or refused is `api_fields.py`'s table, under "responses".
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from phalanx.serve.api_fields import RESPONSES, refusal
from phalanx.serve.api_requests import ApiError, Generation, parse_chat

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
"""Input roles as the chat template knows them (a developer message is the system's, as OpenAI
defines it for models without the role)."""
CHAT_NAMES = {"max_output_tokens": "max_tokens", "input": "messages"}
"""Responses' names of the chat fields they are read as (an error names the one the client sent)."""


def parse_responses(body) -> Generation:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if problem := refusal(body, RESPONSES):
        raise ApiError(400, problem[1], problem[0])
    if body.get("input") is None:
        raise ApiError(400, "input is required", "input")
    chat = {"messages": _messages(body), "model": body.get("model"), "stream": body.get("stream"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_tokens": body.get("max_output_tokens"), "user": body.get("user"),
            "service_tier": body.get("service_tier")}
    if body.get("top_logprobs") is not None:
        chat.update(logprobs=True, top_logprobs=body["top_logprobs"])
    try:
        gen = parse_chat({name: value for name, value in chat.items() if value is not None})
    except ApiError as error:
        error.param = {chat_name: name for name, chat_name in CHAT_NAMES.items()}.get(error.param, error.param)
        raise
    gen.asked = frozenset(CHAT_NAMES.get(name, name) for name in gen.asked)
    return gen


def _messages(body: dict) -> list[dict]:
    """`instructions` and `input` as chat messages."""
    given = body["input"]
    messages = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise ApiError(400, "instructions must be a string", "instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ApiError(400, "input must be a string or a non-empty list of message items", "input")
    for index, item in enumerate(given):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in ROLES:
            raise ApiError(400, f"input[{index}] must be a message item with a role among {', '.join(ROLES)} (other "
                                "item types, such as function calls, are not there yet)", "input")
        content = item.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                       and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"input[{index}].content: only input_text and output_text parts are supported",
                               "input")
            content = "".join(part["text"] for part in content)
        elif not isinstance(content, str):
            raise ApiError(400, f"input[{index}].content must be a string or a list of text parts", "input")
        messages.append({"role": ROLES[item["role"]], "content": content})
    return messages


@dataclass
class ResponsesAnswer:
    """One response as it grows, with the interface of api_responses.Answer (one choice)."""
    gen: Generation
    model: str
    prompts: list[list[int]]
    token_text: Callable[[int], str]
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    sequence: int = 0
    cached_tokens: int = 0

    def __post_init__(self):
        self.item_id = "msg_" + uuid.uuid4().hex

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, index: int, piece) -> list[dict]:
        """Adds the piece; its log-probability entries (empty unless top_logprobs was asked)."""
        self.text += piece.text
        entries = []
        if piece.token is not None:
            self.tokens.append(piece.token)
            if piece.logprob is not None and self.gen.logprobs is not None:
                entries = [self._logprob(piece.token, piece.logprob, piece.top_logprobs or [])]
                self.logprobs += entries
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.cached_tokens = piece.cached_tokens
        return entries

    def _logprob(self, token: int, logprob: float, top) -> dict:
        def one(t, value):
            text = self.token_text(t)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {**one(token, logprob), "top_logprobs": [one(t, v) for t, v in top]}

    def _content(self, text: str, logprobs: list) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _item(self, status: str, content: list) -> dict:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def response(self, status: str) -> dict:
        done = status != "in_progress"
        prompt = len(self.prompts[0])
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": [self._item("completed" if done else "in_progress", [self._content(self.text, self.logprobs)])]
            if done else [],
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "instructions": None, "max_output_tokens": self.gen.max_tokens, "metadata": {},
            "parallel_tool_calls": True, "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": self.gen.temperature, "top_p": self.gen.top_p, "text": {"format": {"type": "text"}},
            "tool_choice": "none", "tools": [], "truncation": "disabled", "user": None,
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                      "output_tokens": len(self.tokens), "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt + len(self.tokens)} if done else None,
        }

    def _status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def final(self) -> dict:
        return self.response(self._status())

    def _event(self, kind: str, **body) -> str:
        self.sequence += 1
        payload = {"type": kind, "sequence_number": self.sequence - 1, **body}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def first_chunks(self) -> list[str]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress")),
                self._event("response.output_item.added", output_index=0, item=self._item("in_progress", [])),
                self._event("response.content_part.added", **self._where(), part=self._content("", []))]

    def piece_chunk(self, index: int, piece) -> str | None:
        entries = self.add(index, piece)
        if not piece.text and not entries:
            return None
        return self._event("response.output_text.delta", **self._where(), delta=piece.text, logprobs=entries)

    def last_chunks(self) -> list[str]:
        part = self._content(self.text, self.logprobs)
        status = self._status()
        return [self._event("response.output_text.done", **self._where(), text=self.text, logprobs=self.logprobs),
                self._event("response.content_part.done", **self._where(), part=part),
                self._event("response.output_item.done", output_index=0, item=self._item("completed", [part])),
                self._event(f"response.{status}", response=self.response(status))]

    def error_chunk(self, error: ApiError) -> str:
        return self._event("error", code=error.code, message=error.message, param=error.param)
