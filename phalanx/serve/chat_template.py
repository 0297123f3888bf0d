"""Chat messages to prompt text, with the model directory's own template.

The template is `chat_template.jinja` beside the tokenizer (transformers 5 saves it there),
else `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates, of which
"default"), rendered with jinja2 in a sandbox, as transformers renders it: `messages`,
`add_generation_prompt=True`, `bos_token`, `eos_token`, `raise_exception`.

`phalanx serve --chat-template FILE` replaces them with that file (a jinja template, as vLLM's
flag). A request's `chat_template_kwargs` become the template's variables (Qwen 3's
`enable_thinking`, say), as vLLM passes them to `apply_chat_template`.

The template's text also says which format tool calls come back in (tool_call_parsers.py), unless
`phalanx serve --tool-call-parser NAME` names it.

Without any, the documented plain fallback: one line `role: content` per message, then
`assistant:` (docs/serve.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from phalanx.errors import UserError
from phalanx.serve import tool_call_parsers


def _token_text(value) -> str:
    if isinstance(value, dict):  # an AddedToken as saved by older tokenizers
        return value.get("content", "")
    return value or ""


class ChatTemplate:
    def __init__(self, model_dir: Path | None, template_file: str | None = None, tool_call_parser: str | None = None):
        """`template_file`: --chat-template, read here (UserError when it cannot be);
        `tool_call_parser`: --tool-call-parser, a name in tool_call_parsers.PARSERS (None: as the
        template shows)."""
        self.source, text, config = "plain", None, {}
        if model_dir is not None:
            config_path = Path(model_dir) / "tokenizer_config.json"
            if config_path.is_file():
                config = json.loads(config_path.read_text())
            jinja_path = Path(model_dir) / "chat_template.jinja"
            if jinja_path.is_file():
                text, self.source = jinja_path.read_text(), str(jinja_path)
            elif config.get("chat_template"):
                text = config["chat_template"]
                if isinstance(text, list):
                    named = {entry.get("name"): entry.get("template") for entry in text}
                    text = named.get("default") or next(iter(named.values()))
                self.source = str(config_path)
        if template_file is not None:
            try:
                text, self.source = Path(template_file).read_text(encoding="utf-8"), template_file
            except (OSError, UnicodeDecodeError) as error:
                raise UserError(f"--chat-template {template_file}: {getattr(error, 'strerror', None) or error}") from None
        self.tool_call_format = tool_call_parser or tool_call_parsers.detect(text)
        """The format the model writes tool calls in (a name in tool_call_parsers.PARSERS), as
        --tool-call-parser names it or else as its template shows it; None: none phalanx parses."""
        self.tokens = {"bos_token": _token_text(config.get("bos_token")), "eos_token": _token_text(config.get("eos_token"))}
        self.template = None
        if text:
            # Imported when run, not at the top: it brings in jinja2, which start-up need not wait for.
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = raise_exception
            try:
                self.template = env.from_string(text)
            except Exception as error:  # jinja2's TemplateSyntaxError: the template's author's, said in one line
                raise UserError(f"the chat template {self.source} does not compile: {error}") from None

    def render(self, messages: list[dict], tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """The prompt text; ValueError when the template refuses the messages. `tools`: the
        request's functions, which templates that know tools (Qwen's, Llama 3's) describe to the
        model (the plain fallback does not); `variables`: chat_template_kwargs (checked by the
        request parser: they never replace messages, tools or add_generation_prompt)."""
        if self.template is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        extra = {"tools": tools} if tools else {}
        try:
            return self.template.render(**{**self.tokens, **(variables or {})}, messages=messages,
                                        add_generation_prompt=True, **extra)
        except ValueError:
            raise
        except Exception as error:  # a template error is the request's (e.g. a role it does not know)
            raise ValueError(f"the chat template failed: {error}") from None
