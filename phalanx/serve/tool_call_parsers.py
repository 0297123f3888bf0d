"""The formats `tool_choice` "auto" reads a model's tool calls in, by name (vLLM's
`--tool-call-parser` names), and which one a chat template shows.

Each is a module with `parse(text) -> (content, calls)` for a finished answer, `sendable(text)`
for a streamed one (how much can go out as content: none of what may be the start of a call;
on a finished answer with calls, where its content ends) and `TEMPLATE_MARKER`, the text by
which a chat template shows it asks for that format.
"""

from __future__ import annotations

from phalanx.serve import hermes_tool_calls, llama3_json_tool_calls

PARSERS = {"hermes": hermes_tool_calls, "llama3_json": llama3_json_tool_calls}
"""In the order `detect` tries them: Hermes first, as before Llama 3's was added (a template that
shows `<tool_call>` writes calls that way whatever else it says)."""


def detect(template: str | None) -> str | None:
    """The format a chat template's text asks the model to write calls in; None: none known."""
    return next((name for name, parser in PARSERS.items() if template and parser.TEMPLATE_MARKER in template), None)
