"""Tool calls in a model's own text, Llama 3's JSON format (vLLM's `llama3_json` parser): the
whole answer is one or more JSON objects `{"name": ..., "parameters": {...}}` ("arguments" also
taken), separated by `;`, optionally behind `<|python_tag|>`. Meta's Llama 3.1, 3.2 and 3.3
templates ask for it ("Respond in the format {"name": function name, "parameters": dictionary of
argument name and its value}") and render earlier calls that way.

The calls must be the whole answer (whitespace aside), so that an answer that quotes or is JSON
is not taken for a call: a text that only contains a JSON object somewhere, an object without a
string "name" and a "parameters" or "arguments", or JSON that does not parse, leaves the whole
answer as content (`{"name": "Ada"}`, an answer about people, is no call). A call has no content
beside it.

Streamed, an answer that may still become calls (it starts with `{` or `<|python_tag|>`, or is
only whitespace so far) is held back until it ends; any other answer streams as it comes.
"""

from __future__ import annotations

import json

from phalanx.serve.hermes_tool_calls import ToolCall

PYTHON_TAG = "<|python_tag|>"
TEMPLATE_MARKER = '{"name": function name, "parameters"'
"""What a chat template says when it asks for these calls: the instruction Meta's Llama 3.1-3.3
templates (and vLLM's tool_chat_template_llama3.1_json.jinja) give the model. Not `<|python_tag|>`:
in those templates it marks the built-in tools' `name.call(...)` code, another format, and it
appears in templates that write no JSON calls; not `"parameters"` alone: any template that lists
a tool's schema may spell it."""
_DECODER = json.JSONDecoder()


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer; not calls: the text as it is."""
    rest = text.strip()
    if rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG):].lstrip()
    if not rest.startswith("{"):
        return text, []
    calls, at = [], 0
    while True:
        try:
            call, at = _DECODER.raw_decode(rest, at)
        except ValueError:
            return text, []
        arguments = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
        if arguments is None or not isinstance(call.get("name"), str):
            return text, []
        calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str)
                              else json.dumps(arguments, ensure_ascii=False)))
        at = _skip_space(rest, at)
        if at == len(rest):
            return None, calls
        if rest[at] != ";":
            return text, []
        at = _skip_space(rest, at + 1)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def sendable(text: str) -> int:
    """How much of a growing answer can be streamed as content: nothing while it may still be
    calls, all of it once it cannot. (On a finished answer that is calls: 0, no content.)"""
    start = text.lstrip()
    if not start or start.startswith("{") or start.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(start):
        return 0
    return len(text)
