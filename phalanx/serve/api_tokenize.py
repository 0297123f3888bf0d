"""vLLM's /tokenize and /detokenize, in its request and answer shapes.

/tokenize takes `{"prompt": TEXT}` (the ids /v1/completions would feed for that prompt,
`add_special_tokens` default true) or `{"messages": [...]}` (the chat template rendered, as
/v1/chat/completions would feed it, `add_special_tokens` default false) and answers
`{"count", "max_model_len", "tokens", "token_strs": null}`; /detokenize takes `{"tokens": [...]}`
and answers `{"prompt": TEXT}` (special tokens included, as vLLM's `tokenizer.decode`). Fields
outside vLLM's schemas are refused with 400 naming them, as on the /v1 routes.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from phalanx.serve.api_requests import ApiError, checked_messages, template_variables
from phalanx.serve.http_limits import ClientGone, read_json

PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
CHAT_FIELDS = {"model", "messages", "add_special_tokens", "add_generation_prompt", "continue_final_message",
               "return_token_strs", "chat_template_kwargs"}
DETOKENIZE_FIELDS = {"model", "tokens"}
NEUTRAL = {"add_generation_prompt": True, "continue_final_message": False, "return_token_strs": False}
"""Fields accepted only with these values, as on /v1/chat/completions (api_fields.py says why)."""


async def tokenize(request: Request, state) -> Response:
    try:
        body = await _body(request, state, lambda body: CHAT_FIELDS if "messages" in body else PROMPT_FIELDS)
        chat = "messages" in body
        special = body.get("add_special_tokens", not chat)
        if not isinstance(special, bool):
            raise ApiError(400, f"add_special_tokens must be true or false, got {special!r}", "add_special_tokens")
        if chat:
            messages = checked_messages(body)
            try:
                text = state.chat_template.render(messages, variables=template_variables(body))
            except ValueError as error:
                raise ApiError(400, str(error), "messages") from None
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise ApiError(400, "prompt must be a string (or give messages)", "prompt")
        encode = state.codec.encode_special if special and state.codec.encode_special else state.codec.encode
        ids = await asyncio.to_thread(encode, text)  # a long text's tokenizing holds no one else
    except ApiError as error:
        return JSONResponse(error.body(), status_code=error.status)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse({"count": len(ids), "max_model_len": state.max_len, "tokens": ids, "token_strs": None})


async def detokenize(request: Request, state) -> Response:
    try:
        body = await _body(request, state, lambda body: DETOKENIZE_FIELDS)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError(400, f"tokens must be a list of token ids, got {tokens!r}"[:300], "tokens")
        outside = [t for t in tokens if not 0 <= t < state.vocab_size]
        if outside:
            raise ApiError(400, f"token id {outside[0]} is outside the vocabulary (0 to {state.vocab_size - 1})", "tokens")
        text = await asyncio.to_thread(state.codec.decode, tokens)
    except ApiError as error:
        return JSONResponse(error.body(), status_code=error.status)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse({"prompt": text})


async def _body(request: Request, state, schema) -> dict:
    """The checked JSON body; `schema(body)`: the fields its form takes."""
    body = await read_json(request, state.max_request_bytes)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    fields = schema(body)
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r} for {request.url.path} (its fields: "
                            f"{', '.join(sorted(fields))})", unknown[0])
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}", "model",
                       "model_not_found")
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] != neutral:
            raise ApiError(400, f"{name}: only {str(neutral).lower()} is taken here (as on /v1/chat/completions)", name)
    return body
