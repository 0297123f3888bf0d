"""Tool calls in a model's own text, Hermes' format (Qwen 2.5 and 3, Hermes, and others whose chat
template writes it): each call a JSON object `{"name": ..., "arguments": {...}}` between
`<tool_call>` and `</tool_call>`, the text before the first call the answer's content.

This is what `tool_choice` "auto" reads (the model chooses whether to call); a chat template
that mentions `<tool_call>` is taken to use it (`tool_call_parsers.py`). A call whose JSON does not
parse leaves the whole answer text, as vLLM's hermes parser does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TEMPLATE_MARKER = OPEN
"""A chat template that mentions `<tool_call>` is taken to ask for this format (tool_call_parsers.py)."""
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's `function.arguments`)."""


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer; no calls: the text as it is."""
    if OPEN not in text:
        return text, []
    calls = []
    for closed, unclosed in _CALL.findall(text):
        try:
            call = json.loads(closed or unclosed)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str)
                              else json.dumps(arguments, ensure_ascii=False)))
    content = text[:text.index(OPEN)].strip()
    return content or None, calls


def sendable(text: str) -> int:
    """How much of a growing answer can be streamed as content: up to its first `<tool_call>`,
    less an ending that might be the start of one."""
    if OPEN in text:
        return text.index(OPEN)
    for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
