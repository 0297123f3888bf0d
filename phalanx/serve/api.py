"""The HTTP API on Starlette: OpenAI's /v1/models, /v1/completions and /v1/chat/completions
(streamed as server-sent events as OpenAI sends them), /health and /metrics.

A handler checks the request (`api_requests.py`), turns the prompt into ids, submits a
`Sequence` to the engine thread (`engine_loop.py`) and relays the pieces of text it hands back,
either as they come (stream) or all at once. A client gone mid-request is noticed (the stream's
send fails, or a poll of the connection) and its sequence aborted, which frees its blocks at the
next step.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from phalanx.serve.api_requests import ApiError, Generation, parse_chat, parse_completion
from phalanx.serve.api_responses import DONE, Answer, sse
from phalanx.serve.detokenize import IncrementalText
from phalanx.serve.engine import request_sampling
from phalanx.serve.engine_loop import EngineLoop, NotAccepting
from phalanx.serve.http_limits import DEFAULT_MAX_REQUEST_BYTES, ApiKeyCheck, ClientGone, read_json
from phalanx.scheduling.scheduler import QueueFull, Sequence
from phalanx.scheduling.slo_policy import SloUnattainable

DISCONNECT_POLL_S = 0.5


@dataclass
class ServeState:
    """What the handlers need, set up once by the server."""
    model_name: str
    engine: EngineLoop
    codec: object
    """phalanx.inference.model_source.TextCodec: encode, decode, eos_id."""
    chat_template: object
    metrics: object
    max_len: int
    vocab_size: int
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def build_app(state: ServeState) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                                          "owned_by": "phalanx", "max_model_len": state.max_len}]})

    async def health(request: Request) -> Response:
        if state.engine.failed:
            return JSONResponse({"status": "failed", "reason": state.engine.failed}, status_code=503)
        if not state.engine.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        if not state.engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def completions(request: Request) -> Response:
        return await _generate(request, state, parse_completion)

    async def chat(request: Request) -> Response:
        return await _generate(request, state, parse_chat)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(ApiError(exc.status_code, exc.detail or "not found", code=str(exc.status_code)))

    app = Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error}, middleware=[Middleware(ApiKeyCheck, key=state.api_key)])
    return app


async def _generate(request: Request, state: ServeState, parse) -> Response:
    try:
        body = await read_json(request, state.max_request_bytes)  # the key: http_limits.ApiKeyCheck
        gen = parse(body)
        model = body.get("model")
        if model is not None and model != state.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                           "model", "model_not_found")
        prompt = await asyncio.to_thread(_prompt_ids, gen, state)  # a long prompt's tokenizing holds no one else
        seq = Sequence("", prompt, gen.max_tokens, frozenset({state.codec.eos_id}) - {None},
                       sampling=request_sampling(gen.temperature, gen.top_p, gen.top_k, gen.seed, gen.logprobs))
        try:
            handle = state.engine.submit(seq, IncrementalText(state.codec.decode, gen.stop))
        except QueueFull as error:
            raise ApiError(429, str(error), code="queue_full") from None
        except SloUnattainable as error:
            raise ApiError(429, str(error), code="ttft_target_unattainable") from None
        except NotAccepting as error:
            raise ApiError(503, str(error), code="not_ready") from None
        except ValueError as error:
            raise ApiError(400, str(error), "max_tokens") from None
    except ApiError as error:
        return error_response(error)
    except ClientGone:
        return Response(status_code=499)
    answer = Answer(gen, state.model_name, prompt, lambda token: state.codec.decode([token]))
    seq.seq_id = answer.id
    if gen.stream:
        return StreamingResponse(_stream(handle, answer, state), media_type="text/event-stream")
    while True:
        try:
            piece = await asyncio.wait_for(handle.queue.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                state.engine.abort(handle)
                return Response(status_code=499)
            continue
        if piece.error:
            return error_response(ApiError(piece.status, piece.error, code=piece.code, kind="server_error" if piece.status >= 500 else None))
        answer.add(piece)
        if piece.finish_reason:
            return JSONResponse(answer.final())


async def _stream(handle, answer: Answer, state: ServeState):
    try:
        first = answer.first_chunk()
        if first:
            yield first
        offset = 0
        while True:
            piece = await handle.queue.get()
            if piece.error:
                yield sse(ApiError(piece.status, piece.error, code=piece.code, kind="server_error" if piece.status >= 500 else None).body())
                break
            chunk = answer.piece_chunk(piece, offset)
            offset += len(piece.text)
            answer.add(piece)
            if chunk:
                yield chunk
            if piece.finish_reason:
                usage = answer.usage_chunk()
                if usage:
                    yield usage
                break
        yield DONE
    finally:  # the client went away (the response was cancelled) or the stream ended
        state.engine.abort(handle)


def _prompt_ids(gen: Generation, state: ServeState) -> list[int]:
    if gen.chat:
        try:
            gen.prompt_text = state.chat_template.render(gen.messages)
        except ValueError as error:
            raise ApiError(400, str(error), "messages") from None
    prompt = gen.prompt if gen.prompt is not None else state.codec.encode(gen.prompt_text)
    if not prompt:
        raise ApiError(400, "the prompt encodes to no tokens", "prompt")
    outside = [t for t in prompt if not 0 <= t < state.vocab_size]
    if outside:
        raise ApiError(400, f"prompt token id {outside[0]} is outside the vocabulary (0 to {state.vocab_size - 1})", "prompt")
    room = state.max_len - len(prompt)
    if room < 1:
        raise ApiError(400, f"the prompt has {len(prompt)} tokens; the model's context is {state.max_len}", "prompt")
    if gen.max_tokens is None:  # as many as fit: the context, and the KV cache (its last token needs no keys)
        gen.max_tokens = max(1, min(room, state.engine.positions() - len(prompt) + 1))
    elif gen.max_tokens > room:
        raise ApiError(400, f"a prompt of {len(prompt)} tokens + max_tokens {gen.max_tokens} = "
                            f"{len(prompt) + gen.max_tokens} exceeds the model's context of {state.max_len}", "max_tokens")
    return prompt
