"""The bodies of /v1/completions and /v1/chat/completions, checked field by field.

Every mistake is an `ApiError` carrying its HTTP status and OpenAI's error body
(`{"error": {"message", "type", "param", "code"}}`), never a traceback; fields OpenAI clients
send that do not change the result here (`user`, zero penalties) are accepted, those that
would (`n` > 1, `best_of`, penalties, `echo`) are refused rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.inference.sampling import MIN_TEMPERATURE, MIN_TOP_P
from phalanx.serve.pool_router import SERVICE_TIERS

MAX_LOGPROBS = 5
MAX_STOPS = 4


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
    prompt: list[int] | None = None
    """Token ids; None for chat until the template is rendered."""
    prompt_text: str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    return_token_ids: bool = False
    chat: bool = False


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


def _refuse_unsupported(body: dict) -> None:
    n = _number(body, "n", 1, 1, 128, integer=True)
    if n != 1:
        raise _bad(f"n = {n}: this server returns one choice per request (n = 1)", "n")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise _bad(f"best_of = {best_of!r} is not supported (1 only)", "best_of")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, 0, -2, 2) != 0:
            raise _bad(f"{name} is not supported (0 only)", name)
    if body.get("logit_bias"):
        raise _bad("logit_bias is not supported", "logit_bias")


def _common(body: dict, gen: Generation, max_tokens_default: int | None) -> None:
    _refuse_unsupported(body)
    gen.max_tokens = _number(body, "max_tokens", max_tokens_default, 1, 1 << 20, integer=True)
    gen.temperature = _number(body, "temperature", 1.0, 0, 2)
    if 0 < gen.temperature < MIN_TEMPERATURE:  # the sampler's bound (phalanx generate's), so it never sees nan
        raise _bad(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {gen.temperature}", "temperature")
    gen.top_p = _number(body, "top_p", 1.0, MIN_TOP_P, 1)
    top_k = _number(body, "top_k", None, -1, 1 << 20, integer=True)
    gen.top_k = None if top_k in (None, -1, 0) else top_k  # vLLM's -1 and 0: no cut
    gen.seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOPS:
        raise _bad(f"stop must be a string or a list of at most {MAX_STOPS} strings, got {stop!r}", "stop")
    gen.stop = stop
    gen.stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not gen.stream:
            raise _bad("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict):
            raise _bad("stream_options must be an object", "stream_options")
        gen.include_usage = _flag(options, "include_usage")
    gen.return_token_ids = _flag(body, "return_token_ids")
    tier = body.get("service_tier")
    if tier is not None and (not isinstance(tier, str) or tier not in SERVICE_TIERS):  # it picks a pool under --pool (pool_router.py)
        raise _bad(f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {tier!r}", "service_tier")


def parse_completion(body) -> Generation:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    gen = Generation()
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        gen.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        gen.prompt = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad(f"a batch of {len(prompt)} prompts: this server takes one prompt per request", "prompt")
    else:
        raise _bad("prompt must be a non-empty string or a non-empty list of token ids", "prompt")
    if _flag(body, "echo"):
        raise _bad("echo is not supported", "echo")
    _common(body, gen, 16)
    gen.logprobs = _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    return gen


def parse_chat(body) -> Generation:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    gen = Generation(chat=True)
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
    gen.messages = checked
    body = dict(body)
    if body.get("max_completion_tokens") is not None:  # OpenAI's newer name for max_tokens
        if body.get("max_tokens") is not None and body["max_tokens"] != body["max_completion_tokens"]:
            raise _bad(f"max_tokens {body['max_tokens']!r} and max_completion_tokens {body['max_completion_tokens']!r} "
                       "disagree; give one", "max_completion_tokens")
        body["max_tokens"] = body["max_completion_tokens"]
    _common(body, gen, None)  # None: as many as the context holds
    if _flag(body, "logprobs"):
        gen.logprobs = _number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
    elif body.get("top_logprobs") is not None:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return gen
