"""The HTTP API on Starlette: OpenAI's /v1/models, /v1/completions, /v1/chat/completions and
/v1/responses (`api_v1_responses.py`; streamed as server-sent events as OpenAI sends them), vLLM's /tokenize and /detokenize
(`api_tokenize.py`), /health and /metrics; every route but the last two answers 503 until the
model can serve (`api_readiness.py`).

A handler checks the request (`api_requests.py`), turns the prompt into ids, submits a
`Sequence` to the engine thread (`engine_loop.py`) and relays the pieces of text it hands back,
either as they come (stream) or all at once. A client gone mid-request is noticed (the stream's
send fails, or a poll of the connection) and its sequence aborted, which frees its blocks at the
next step.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from phalanx.errors import UserError
from phalanx.inference.grammar import Constraint, GrammarError, Grammars, Vocabulary
from phalanx.inference.sampling import Sampling
from phalanx.scheduling.request import Request as EngineRequest  # not starlette's Request, the HTTP one
from phalanx.scheduling.scheduler import QueueFull, Sequence
from phalanx.scheduling.slo_policy import SloUnattainable
from phalanx.serve.api_readiness import ReadinessGate
from phalanx.serve.api_requests import ApiError, Generation, parse_chat, parse_completion, prompt_alternatives
from phalanx.serve.api_responses import Answer
from phalanx.serve.api_tokenize import detokenize, tokenize
from phalanx.serve.api_v1_responses import ResponsesAnswer, parse_responses
from phalanx.serve.detokenize import IncrementalText
from phalanx.serve.sampling_params import Draws, openai_sampling, seeded
from phalanx.serve.engine_loop import EngineLoop, NotAccepting
from phalanx.serve.http_limits import DEFAULT_MAX_REQUEST_BYTES, ApiKeyCheck, ClientGone, read_json
from phalanx.serve.tool_call_parsers import PARSERS

DISCONNECT_POLL_S = 0.5


@dataclass
class ServeState:
    """What the handlers need, set up once by the server."""
    model_name: str
    engine: EngineLoop
    codec: object
    """phalanx.inference.model_source.TextCodec: encode, decode, ends of sequence."""
    chat_template: object
    metrics: object
    max_len: int
    vocab_size: int
    api_key: str | None = None
    sampling_defaults: dict = field(default_factory=dict)
    """generation_config.json's sampling settings for fields a request leaves out (empty under
    `--generation-config vllm`)."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    grammars: Grammars | None = None
    """Structured output's compiled grammars for this tokenizer (made on the first request that asks)."""

    def __post_init__(self):
        if self.grammars is None:
            self.grammars = Grammars(Vocabulary(getattr(self.codec, "tokenizer_file", None), self.vocab_size,
                                                frozenset(getattr(self.codec, "eos_ids", ()))))


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
        # Imported when run, not at the top: it brings in prometheus_client, which start-up need not wait for.
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def completions(request: Request) -> Response:
        return await _generate(request, state, parse_completion)

    async def chat(request: Request) -> Response:
        return await _generate(request, state, parse_chat)

    async def responses(request: Request) -> Response:
        return await _generate(request, state, parse_responses, _responses_answer)

    async def to_ids(request: Request) -> Response:
        return await tokenize(request, state)

    async def to_text(request: Request) -> Response:
        return await detokenize(request, state)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(ApiError(exc.status_code, exc.detail or "not found", code=str(exc.status_code)))

    app = Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/tokenize", to_ids, methods=["POST"]),
        Route("/detokenize", to_text, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error},
        # The key first: a request without it gets 401 whether or not the model is in.
        middleware=[Middleware(ApiKeyCheck, key=state.api_key), Middleware(ReadinessGate, engine=state.engine)])
    return app


async def _generate(request: Request, state: ServeState, parse, answer_for=None) -> Response:
    """`parse(body)`: the request's Generation; `answer_for(gen, prompts, state)`: what builds its
    answer (a completion or chat completion by default; api_v1_responses for /v1/responses)."""
    handles: list = []
    try:
        body = await read_json(request, state.max_request_bytes)  # the key: http_limits.ApiKeyCheck
        gen = parse(body)
        model = body.get("model")
        if model is not None and model != state.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                           "model", "model_not_found")
        prompts = await asyncio.to_thread(_prompt_ids, gen, state)  # a long prompt's tokenizing holds no one else
        sampling = _sampling(gen, state)
        grammar = None if gen.constraint is None else await asyncio.to_thread(_compile, gen.constraint, state)
        for prompt in prompts:
            max_tokens = _max_tokens(gen, prompt, state)
            # best_of > n: every candidate's log-probabilities, to rank them by (api_responses.Answer)
            logprobs = 0 if gen.best_of > gen.n and gen.logprobs is None else gen.logprobs
            for choice in range(gen.best_of):
                seed = None if gen.seed is None else gen.seed + choice  # choice i of a seeded request: seed + i
                ends = _ends(gen, state)
                matcher = None if grammar is None else state.grammars.matcher(grammar, ends)
                if matcher is not None and choice == 0 and not (matcher.terminated or matcher.can_begin()):
                    raise ApiError(400, f"{gen.constraint.param}: no token of this model's vocabulary can begin an "
                                        "answer the constraint allows", gen.constraint.param)
                wanted = EngineRequest(tuple(prompt), max_tokens, ends, seeded(sampling, seed, logprobs, gen.min_tokens),
                                       prompt_alternatives(gen))
                # Guesses are checked token by token; a grammar's state and log-probabilities are not (yet).
                seq = Sequence("", wanted, draws=Draws(grammar=matcher),
                               may_speculate=matcher is None and logprobs is None and wanted.prompt_logprobs is None)
                handles.append(_submit(state, seq, gen))
    except ApiError as error:
        for handle in handles:  # a later prompt was refused: the earlier ones stop
            state.engine.abort(handle)
        return error_response(error)
    except ClientGone:
        return Response(status_code=499)
    answer = (answer_for or _completion_answer)(gen, prompts, state)
    for handle in handles:
        handle.seq.seq_id = answer.id
    pieces, relays = _merged(handles)
    if gen.stream:
        return StreamingResponse(_stream(pieces, handles, relays, answer, state), media_type="text/event-stream")
    try:
        while not answer.finished:
            try:
                index, piece = await asyncio.wait_for(pieces.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            if piece.error:
                return error_response(_piece_error(piece))
            answer.add(index, piece)
        return JSONResponse(answer.final())
    finally:
        _end(handles, relays, state)


def _completion_answer(gen: Generation, prompts: list[list[int]], state: ServeState) -> Answer:
    echoed = [text if isinstance(text, str) else state.codec.decode(ids) for text, ids in zip(gen.prompts, prompts)]
    parser = PARSERS[state.chat_template.tool_call_format] if gen.chat and gen.tool_call == "auto" else None
    return Answer(gen, state.model_name, prompts, lambda token: state.codec.decode([token]), echoed if gen.echo else None,
                  parser)


def _responses_answer(gen: Generation, prompts: list[list[int]], state: ServeState) -> ResponsesAnswer:
    return ResponsesAnswer(gen, state.model_name, prompts, lambda token: state.codec.decode([token]))


def _piece_error(piece) -> ApiError:
    """The error the engine ended a choice with, as the client is told it."""
    return ApiError(piece.status, piece.error, code=piece.code, kind="server_error" if piece.status >= 500 else None)


def _end(handles: list, relays: list, state: ServeState) -> None:
    """The request is answered or its client gone: unfinished choices stop, relays end."""
    for handle in handles:
        state.engine.abort(handle)
    for relay in relays:
        relay.cancel()


def _submit(state: ServeState, seq: Sequence, gen: Generation):
    decode = state.codec.decode_plain if gen.skip_special_tokens and state.codec.decode_plain else state.codec.decode
    text = IncrementalText(decode, gen.stop, keep_stop=gen.include_stop_str_in_output, min_tokens=gen.min_tokens)
    try:
        return state.engine.submit(seq, text)
    except QueueFull as error:
        raise ApiError(429, str(error), code="queue_full") from None
    except SloUnattainable as error:
        raise ApiError(429, str(error), code="ttft_target_unattainable") from None
    except NotAccepting as error:
        raise ApiError(503, str(error), code="not_ready") from None
    except ValueError as error:
        raise ApiError(400, str(error), "max_tokens") from None


def _merged(handles: list) -> tuple:
    """(choice index, piece) from every handle, in the order they come, and the tasks that
    relay them: each handle's queue is read by a task of its own that ends with its last piece."""
    if len(handles) == 1:  # the common case: no task, the handle's queue read through a view
        return _SingleQueue(handles[0].queue), []
    merged: asyncio.Queue = asyncio.Queue()

    async def relay(index: int, handle) -> None:
        while True:
            piece = await handle.queue.get()
            merged.put_nowait((index, piece))
            if piece.finish_reason or piece.error:
                return

    return merged, [asyncio.ensure_future(relay(index, handle)) for index, handle in enumerate(handles)]


class _SingleQueue:
    """One handle's queue as (0, piece) pairs."""

    def __init__(self, queue: asyncio.Queue):
        self.queue = queue

    async def get(self):
        return 0, await self.queue.get()


def _ends(gen: Generation, state: ServeState) -> frozenset[int]:
    """The ids that end a choice: the model's ends of sequence (unless ignore_eos) and the
    request's stop_token_ids."""
    eos = frozenset() if gen.ignore_eos else (state.codec.eos_ids or frozenset({state.codec.eos_id}) - {None})
    return eos | frozenset(gen.stop_token_ids)


def _compile(constraint: Constraint, state: ServeState):
    """The constraint's compiled grammar (in a worker thread: a large schema takes a while), or
    a 400 naming the field that gave it."""
    try:
        return state.grammars.compile(constraint)
    except GrammarError as error:
        raise ApiError(400, f"{constraint.param}: cannot be compiled: {error}", constraint.param) from None
    except ImportError:
        raise ApiError(400, f"{constraint.param}: structured output needs xgrammar on the server "
                            "(pip install 'phalanx[structured]')", constraint.param) from None


def _sampling(gen: Generation, state: ServeState) -> Sampling:
    """The request's sampling, the checkpoint's generation_config.json filling the fields the
    request left out (`--generation-config auto`, as vLLM)."""
    values = {name: getattr(gen, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    for name, value in state.sampling_defaults.items():
        if name not in gen.asked:
            values[name] = value
    bias = tuple(sorted(gen.logit_bias.items()))
    outside = [token for token, _ in bias if token >= state.vocab_size]
    if outside:
        raise ApiError(400, f"logit_bias token {outside[0]} is outside the vocabulary (0 to {state.vocab_size - 1})",
                       "logit_bias")
    try:
        return openai_sampling(temperature=values["temperature"], top_p=values["top_p"], top_k=values["top_k"],
                               min_p=values["min_p"], repetition_penalty=values["repetition_penalty"],
                               presence_penalty=gen.presence_penalty, frequency_penalty=gen.frequency_penalty,
                               logit_bias=bias).validate()
    except UserError as error:  # a default from generation_config.json out of range
        raise ApiError(400, f"{error} (with the model's generation_config.json defaults)") from None


async def _stream(pieces, handles: list, relays: list, answer, state: ServeState):
    try:
        for chunk in answer.first_chunks():
            yield chunk
        while not answer.finished:
            index, piece = await pieces.get()
            if piece.error:
                yield answer.error_chunk(_piece_error(piece))
                return
            chunk = answer.piece_chunk(index, piece)
            if chunk:
                yield chunk
        for chunk in answer.last_chunks():
            yield chunk
    finally:  # the client went away (the response was cancelled) or the stream ended
        _end(handles, relays, state)


def _prompt_ids(gen: Generation, state: ServeState) -> list[list[int]]:
    """Each prompt's token ids, checked against the vocabulary and the context."""
    if gen.chat:
        if gen.tool_call == "auto" and state.chat_template.tool_call_format is None:
            raise ApiError(400, 'tool_choice "auto" (the default with tools): this model\'s chat template writes tool '
                                "calls in no format phalanx knows (Hermes' <tool_call> JSON, as Qwen's, or Llama 3's JSON; "
                                "a server started with --tool-call-parser NAME reads NAME's); give "
                                '"required" or {"type": "function", "function": {"name": ...}} (the call is then '
                                'constrained to the function\'s parameters), or "none"', "tool_choice")
        try:
            gen.prompts = [state.chat_template.render(gen.messages, gen.tools, gen.template_variables)]
        except ValueError as error:
            raise ApiError(400, str(error), "messages") from None
    special = gen.add_special_tokens and state.codec.encode_special
    encode = state.codec.encode_special if special else state.codec.encode
    out = []
    for prompt in gen.prompts:
        ids = prompt if isinstance(prompt, list) else encode(prompt)
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", "prompt")
        outside = [t for t in ids if not 0 <= t < state.vocab_size]
        if outside:
            raise ApiError(400, f"prompt token id {outside[0]} is outside the vocabulary (0 to {state.vocab_size - 1})",
                           "prompt")
        if state.max_len - len(ids) < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the model's context is {state.max_len}", "prompt")
        out.append(ids)
    return out


def _max_tokens(gen: Generation, prompt: list[int], state: ServeState) -> int:
    room = state.max_len - len(prompt)
    if gen.max_tokens is None:  # as many as fit: the context, and the KV cache (its last token needs no keys)
        return max(1, min(room, state.engine.positions() - len(prompt) + 1))
    if gen.max_tokens > room:
        raise ApiError(400, f"a prompt of {len(prompt)} tokens + max_tokens {gen.max_tokens} = "
                            f"{len(prompt) + gen.max_tokens} exceeds the model's context of {state.max_len}", "max_tokens")
    return gen.max_tokens
