"""The bodies of /v1/completions and /v1/chat/completions, checked field by field.

Every mistake is an `ApiError` carrying its HTTP status and OpenAI's error body
(`{"error": {"message", "type", "param", "code"}}`), never a traceback. Which fields are
honoured, accepted without effect or refused is `api_fields.py`'s table; the checks of each
honoured field's value are here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from phalanx.inference.grammar import Constraint
from phalanx.inference.sampling_bounds import MIN_TEMPERATURE, MIN_TOP_P
from phalanx.serve.api_fields import CHAT, COMPLETIONS, refusal
from phalanx.serve.pool_router import SERVICE_TIERS

MAX_LOGPROBS = 20
"""vLLM's default `--max-logprobs`, and OpenAI's bound on chat's top_logprobs."""
MAX_STOPS = 4
MAX_N = 16
"""Choices per prompt: each is a sequence of its own in the batch (they share the prompt's
blocks through the prefix cache)."""
MAX_PROMPTS = 64
"""Prompts in one completions request (lm-evaluation-harness sends its --batch_size)."""
MAX_TOKEN_LIST = 4096
"""stop_token_ids and logit_bias entries."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Generation:
    """A checked request: what to feed, how to sample, when to stop, what to answer."""
    prompts: list = field(default_factory=list)
    """Completions: each prompt a string or token ids (one choice per prompt and per n)."""
    messages: list[dict] | None = None
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    n: int = 1
    best_of: int = 1
    """Completions: candidates generated per prompt, of which the n with the highest cumulative
    log-probability are answered (vLLM's and OpenAI's `best_of`); at least n."""
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False
    """Completions: the prompt's text before the completion, and with `logprobs` its tokens."""
    prompt_logprobs: int | None = None
    """vLLM's: each prompt token's log-probability and rank, with this many alternatives."""
    return_token_ids: bool = False
    add_special_tokens: bool = True
    """A text prompt gets the special tokens the tokenizer's post-processor adds (a BOS): vLLM's
    default for completions; chat's default is false (the template writes them)."""
    constraint: Constraint | None = None
    """Structured output: what the answer must match (response_format, guided_*, structured_outputs,
    or the tool call that tool_choice asks for)."""
    tools: list[dict] | None = None
    template_variables: dict = field(default_factory=dict)
    """Chat: chat_template_kwargs, the chat template's own variables (Qwen 3's enable_thinking)."""
    """Chat: the functions the model may call, as given (the chat template sees them)."""
    tool_call: str | None = None
    """Chat: "required" (one or more calls of any of `tools`) or "named" (a call of `tool_name`):
    the answer is constrained to it and returned as `message.tool_calls`; "auto": calls parsed
    from the model's own text where it makes them; None: text."""
    tool_name: str | None = None
    chat: bool = False
    asked: frozenset[str] = frozenset()
    """The fields the body gave (the model's generation_config.json fills the others' defaults)."""


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param)


def _number(body: dict, name: str, default, low: float, high: float, *, integer: bool = False, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value != value:
        raise _bad(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if value < low or (low_open and value == low) or value > high:
        side = f"> {low}" if low_open else f">= {low}"
        raise _bad(f"{name} must be {side} and <= {high}, got {value}", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{name} must be true or false, got {value!r}", name)
    return value


def _token_ids(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if (not isinstance(value, list) or len(value) > MAX_TOKEN_LIST
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
        raise _bad(f"{name} must be a list of at most {MAX_TOKEN_LIST} token ids (integers >= 0), got {value!r}", name)
    return list(value)


def _logit_bias(body: dict) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_TOKEN_LIST:
        raise _bad(f"logit_bias must be an object of at most {MAX_TOKEN_LIST} token ids (as strings) to numbers",
                   "logit_bias")
    bias = {}
    for key, number in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or str(token) != str(key).strip():
            raise _bad(f"logit_bias keys must be token ids written as strings, got {key!r}", "logit_bias")
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not -100 <= number <= 100:
            raise _bad(f"logit_bias values must be numbers in [-100, 100], got {number!r} for token {key}", "logit_bias")
        bias[token] = float(number)
    return bias


def _max_tokens(body: dict, default: int | None) -> int | None:
    """max_completion_tokens wins over max_tokens when both are given (as vLLM reads them)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _number(body, name, default, 1, 1 << 20, integer=True)


def _common(body: dict, gen: Generation, max_tokens_default: int | None) -> None:
    if problem := refusal(body, CHAT if gen.chat else COMPLETIONS):
        raise _bad(problem[1], problem[0])
    gen.asked = frozenset(name for name, value in body.items() if value is not None)
    gen.max_tokens = _max_tokens(body, max_tokens_default)
    gen.temperature = _number(body, "temperature", 1.0, 0, 2)
    if 0 < gen.temperature < MIN_TEMPERATURE:
        raise _bad(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {gen.temperature}: below it "
                   "float32 cannot tell tokens apart", "temperature")
    gen.top_p = _number(body, "top_p", 1.0, MIN_TOP_P, 1)
    top_k = _number(body, "top_k", None, -1, 1 << 20, integer=True)
    gen.top_k = None if top_k in (None, -1, 0) else top_k  # vLLM's -1 and 0: no cut
    gen.min_p = _number(body, "min_p", 0.0, 0, 1)
    gen.presence_penalty = _number(body, "presence_penalty", 0.0, -2, 2)
    gen.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2, 2)
    gen.repetition_penalty = _number(body, "repetition_penalty", 1.0, 0, 1000, low_open=True)
    gen.logit_bias = _logit_bias(body)
    gen.seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    gen.n = _number(body, "n", 1, 1, MAX_N, integer=True)
    best_of = _number(body, "best_of", None, 1, MAX_N, integer=True)
    if best_of is not None and best_of < gen.n:
        raise _bad(f"best_of = {best_of} must be at least n = {gen.n}", "best_of")
    gen.best_of = max(gen.n, best_of or 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOPS:
        raise _bad(f"stop must be a string or a list of at most {MAX_STOPS} strings, got {stop!r}", "stop")
    gen.stop = stop
    gen.stop_token_ids = _token_ids(body, "stop_token_ids")
    gen.ignore_eos = _flag(body, "ignore_eos")
    gen.min_tokens = _number(body, "min_tokens", 0, 0, 1 << 20, integer=True)
    if gen.max_tokens is not None and gen.min_tokens > gen.max_tokens:
        raise _bad(f"min_tokens = {gen.min_tokens} is more than max_tokens = {gen.max_tokens}", "min_tokens")
    gen.include_stop_str_in_output = _flag(body, "include_stop_str_in_output")
    gen.skip_special_tokens = True if body.get("skip_special_tokens") is None else _flag(body, "skip_special_tokens")
    gen.stream = _flag(body, "stream")
    if gen.stream and gen.best_of > gen.n:  # the best are known only at the end (OpenAI refuses it too)
        raise _bad(f"best_of = {gen.best_of} > n = {gen.n} cannot be streamed", "best_of")
    options = body.get("stream_options")
    if options is not None:
        if not gen.stream:
            raise _bad("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict):
            raise _bad("stream_options must be an object", "stream_options")
        gen.include_usage = _flag(options, "include_usage")
    gen.return_token_ids = _flag(body, "return_token_ids")
    gen.constraint = _constraint(body)
    tier = body.get("service_tier")
    if tier is not None and (not isinstance(tier, str) or tier not in SERVICE_TIERS):  # picks a pool (pool_router.py)
        raise _bad(f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {tier!r}", "service_tier")
    for name in ("user", "request_id"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(f"{name} must be a string", name)


CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs")
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                           "json_object": "json_object"}
"""vLLM's `structured_outputs` keys this server honours, and the constraint each is."""


def _constraint(body: dict) -> Constraint | None:
    """The one structured-output constraint of the request, from whichever field gave it."""
    found = [c for name in CONSTRAINT_FIELDS if body.get(name) is not None
             for c in [_constraint_of(name, body[name])] if c is not None]
    if len(found) > 1:
        raise _bad(f"{found[1].param}: one structured-output constraint per request, but {found[0].param} "
                   "gives one too", found[1].param)
    return found[0] if found else None


def _constraint_of(name: str, value) -> Constraint | None:
    if name == "response_format":
        return _response_format(value)
    if name == "guided_json":
        return Constraint("json_schema", _schema_text(value, name), name)
    if name in ("guided_regex", "guided_grammar"):
        if not isinstance(value, str) or not value:
            raise _bad(f"{name} must be a non-empty string, got {value!r}", name)
        return Constraint("regex" if name == "guided_regex" else "grammar", value, name)
    if name == "guided_choice":
        return Constraint("choice", _choices(value, name), name)
    if not isinstance(value, dict):
        raise _bad(f"structured_outputs must be an object with one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}", name)
    # disable_any_whitespace: true asks for what is done anyway (JSON is written compactly, grammar.py).
    given = {key: v for key, v in value.items() if v is not None and v is not False
             and not (key == "disable_any_whitespace" and v is True)}
    other = sorted(set(given) - set(STRUCTURED_OUTPUTS_KEYS))
    if other:
        raise _bad(f"structured_outputs.{other[0]} is not there yet (honoured: {', '.join(STRUCTURED_OUTPUTS_KEYS)})",
                   name)
    if len(given) != 1:
        raise _bad(f"structured_outputs must give exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}, got "
                   f"{sorted(given) or 'none'}", name)
    (key, v), = given.items()
    param = f"{name}.{key}"
    if key == "json":
        return Constraint("json_schema", _schema_text(v, param), name)
    if key == "json_object":
        if v is not True:
            raise _bad(f"{param} must be true, got {v!r}", name)
        return Constraint("json_object", "", name)
    if key == "choice":
        return Constraint("choice", _choices(v, param), name)
    if not isinstance(v, str) or not v:
        raise _bad(f"{param} must be a non-empty string, got {v!r}", name)
    return Constraint(STRUCTURED_OUTPUTS_KEYS[key], v, name)


def _response_format(value) -> Constraint | None:
    name = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("response_format must be an object with a type: text, json_object or json_schema", name)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", name)
    if kind != "json_schema":
        reason = "is not there yet" if kind == "structural_tag" else "is not a response format"
        raise _bad(f"response_format type {kind!r} {reason} (text, json_object or json_schema)", name)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema must be an object with a name and a schema", name)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _bad("response_format.json_schema.name must be a non-empty string", name)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _bad(f"response_format.json_schema.strict must be true or false, got {spec['strict']!r}", name)
    if spec.get("schema") is None:
        raise _bad("response_format.json_schema.schema is required here: the JSON schema the answer must match", name)
    return Constraint("json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema"), name)


def _schema_text(schema, where: str) -> str:
    """A JSON schema (an object, or its JSON text) as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise _bad(f"{where} is a string that is not JSON text", where.split(".")[0]) from None
    if not isinstance(schema, dict):
        raise _bad(f"{where} must be a JSON schema (an object), got {type(schema).__name__}", where.split(".")[0])
    return json.dumps(schema)


def _choices(value, where: str) -> str:
    if (not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value)
            or len(value) > MAX_TOKEN_LIST):
        raise _bad(f"{where} must be a list of 1 to {MAX_TOKEN_LIST} non-empty strings, got {value!r}",
                   where.split(".")[0])
    return json.dumps(value)


def _tools(body: dict, gen: Generation) -> None:
    """`tools`, `tool_choice` and `parallel_tool_calls`: a forced call (required, or a named
    function) is constrained by the functions' parameter schemas, as vLLM does; "none" answers in
    text; "auto" lets the model choose, its calls parsed from its own format (tool_call_parsers.py)."""
    tools = body.get("tools") or []
    if not isinstance(tools, list) or len(tools) > MAX_TOKEN_LIST:
        raise _bad("tools must be a list of functions", "tools")
    names = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise _bad(f'tools[{index}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                       "tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise _bad(f"tools[{index}].function.parameters must be a JSON schema (an object)", "tools")
        names.append(function["name"])
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad(f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's defaults
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}', "tool_choice")
        if name not in names:
            raise _bad(f"tool_choice names the function {name!r}, which is not in tools "
                       f"({', '.join(map(repr, names)) or 'none given'})", "tool_choice")
        gen.tool_call, gen.tool_name = "named", name
        schema = _parameters(tools[names.index(name)]["function"])
    elif choice == "none" or (choice == "auto" and not tools):
        return
    elif choice == "auto":  # the model chooses; its own format is parsed (the server checks it has one)
        gen.tools, gen.tool_call = tools, "auto"
        return
    elif choice == "required":
        if not tools:
            raise _bad('tool_choice "required" needs tools', "tool_choice")
        gen.tool_call = "required"
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                            "parameters": _parameters(tool["function"])},
             "required": ["name", "parameters"]} for tool in tools]}}
        if parallel is False:
            schema["maxItems"] = 1
    else:
        raise _bad(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}', "tool_choice")
    if gen.constraint is not None:
        raise _bad(f"tool_choice {choice!r} constrains the answer to a tool call, and {gen.constraint.param} "
                   "constrains it too: one per request", gen.constraint.param)
    gen.tools, gen.constraint = tools, Constraint("json_schema", json.dumps(schema), "tools")


def _parameters(function: dict) -> dict:
    """A function's parameters schema (none: an object with no properties, as OpenAI reads it)."""
    return function.get("parameters") or {"type": "object", "properties": {}}


def _prompt_list(prompt) -> list:
    """`prompt` as a list of prompts, each a string or a list of token ids."""
    is_ids = lambda value: (isinstance(value, list) and value  # noqa: E731
                            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))
    if isinstance(prompt, str):
        return [prompt]
    if is_ids(prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise _bad(f"a batch of {len(prompt)} prompts: at most {MAX_PROMPTS} in one request", "prompt")
        return [p if isinstance(p, str) else list(p) for p in prompt]
    raise _bad("prompt must be a non-empty string, a non-empty list of token ids, or a list of either", "prompt")


def parse_completion(body) -> Generation:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    gen = Generation()
    if body.get("prompt") is None:
        raise _bad("prompt is required", "prompt")
    gen.prompts = _prompt_list(body["prompt"])
    _common(body, gen, 16)
    gen.add_special_tokens = body.get("add_special_tokens") is None or _flag(body, "add_special_tokens")
    gen.logprobs = _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    gen.echo = _flag(body, "echo")
    gen.prompt_logprobs = _number(body, "prompt_logprobs", None, 0, MAX_LOGPROBS, integer=True)
    return gen


def prompt_alternatives(gen: Generation) -> int | None:
    """How many alternatives each prompt token's score lists (None: the prompt is not scored):
    `echo` with `logprobs` k lists k, as the completion's tokens do; `prompt_logprobs` its own."""
    asked = [k for k in (gen.logprobs if gen.echo else None, gen.prompt_logprobs) if k is not None]
    return max(asked) if asked else None


def checked_messages(body: dict) -> list[dict]:
    """A chat body's messages, each with a role and its content as one string (text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{index}] must be an object with a role", "messages")
        content = message.get("content", "")
        if isinstance(content, list):  # content parts: only text here
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise _bad(f"messages[{index}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"messages[{index}].content must be a string or a list of text parts", "messages")
        checked.append({**message, "content": content})
    return checked


RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt")
"""What the request's own fields set: chat_template_kwargs cannot replace them."""


def template_variables(body: dict) -> dict:
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(f"chat_template_kwargs must be an object of template variables, got {value!r}"[:300],
                   "chat_template_kwargs")
    if taken := [name for name in RESERVED_TEMPLATE_VARIABLES if name in value]:
        raise _bad(f"chat_template_kwargs cannot set {taken[0]}: the request's own field sets it",
                   "chat_template_kwargs")
    return value


def parse_chat(body) -> Generation:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    gen = Generation(chat=True)
    gen.messages = checked_messages(body)
    _common(body, gen, None)  # None: as many as the context holds
    gen.add_special_tokens = _flag(body, "add_special_tokens")
    if _flag(body, "logprobs"):
        gen.logprobs = _number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
    elif body.get("top_logprobs") is not None:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    _tools(body, gen)
    gen.template_variables = template_variables(body)
    if _flag(body, "echo"):
        raise _bad("echo is taken by /v1/completions only here (give the prompt there)", "echo")
    if body.get("prompt_logprobs") is not None:
        raise _bad("prompt_logprobs is taken by /v1/completions only here (give the prompt there)", "prompt_logprobs")
    return gen
