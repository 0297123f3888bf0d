"""What one HTTP client may cost the server, each bound here with its reason; shared by
`phalanx serve` and the pool front (`--pool`).

- A request body is at most `--max-request-bytes` (413 beyond, counted as it arrives, so a
  huge body is never held whole), and must arrive within BODY_TIMEOUT_S (408).
- A connection must send a request's headers within HEADER_TIMEOUT_S of opening, or of its
  previous answer (uvicorn bounds only the idle time between requests, `timeout_keep_alive`,
  and h11 the headers' size; half a header held open would keep a connection forever).
- The body is JSON of bounded depth (Python's parser raises RecursionError far down), and
  every string in it encodes to UTF-8 (a lone UTF-16 surrogate such as "\\ud800" does not, and
  would fail in the tokenizer).
- The API key is checked on every /v1 route (`ApiKeyCheck`), in constant time over its UTF-8
  bytes.
"""

from __future__ import annotations

import asyncio
import hmac
import json

import h11
from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from phalanx.serve.api_requests import ApiError
from phalanx.serve.job import DEFAULT_MAX_REQUEST_BYTES  # noqa: F401 (the bound's home: light, for the flags)

HEADER_TIMEOUT_S = 10.0
"""Seconds a connection has to send a request's headers: a client sends them in one write; ten
seconds covers a slow network many times over."""
BODY_TIMEOUT_S = 60.0
"""Seconds a request's body may take to arrive once its headers have: 4 MiB at 70 KB/s."""


class ClientGone(Exception):
    """The client closed the connection before its body arrived (nobody to answer)."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, within its size and time (ApiError), or ClientGone."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            body = bytearray()
            async for piece in request.stream():
                body += piece
                if len(body) > max_bytes:
                    raise _too_large(len(body), max_bytes)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None
    return bytes(body)


async def read_json(request: Request, max_bytes: int):
    """The request's JSON body, within the bounds of the module docstring (ApiError)."""
    body = await read_body(request, max_bytes)
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "the request body is JSON nested too deep") from None
    try:
        json.dumps(parsed, ensure_ascii=False).encode()
    except UnicodeEncodeError as error:
        bad = error.object[error.start:error.end].encode("unicode_escape").decode()
        raise ApiError(400, f"the request holds a lone UTF-16 surrogate ({bad}), which is not a character") from None
    except RecursionError:
        raise ApiError(400, "the request body is JSON nested too deep") from None
    return parsed


def _too_large(size: int, max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body has {size} bytes or more; this server takes at most {max_bytes} "
                         "(--max-request-bytes)", code="request_too_large")


class ApiKeyCheck:
    """ASGI middleware: every path under /v1 needs `Authorization: Bearer KEY` (401 without)."""

    def __init__(self, app, key: str | None):
        self.app = app
        self.expected = None if key is None else b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send):
        if self.expected is None or scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        # Header bytes are what the client sent (latin-1 on the wire): a UTF-8 key's bytes match.
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        await send_error(send, ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                                        code="invalid_api_key"))


async def send_error(send, error: ApiError) -> None:
    """`error` as an OpenAI error body, sent from ASGI middleware (no Starlette response there)."""
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with HEADER_TIMEOUT_S for each request's headers."""

    header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE and self.header_timer is not None:
            self.header_timer.cancel()  # the headers are in
            self.header_timer = None

    def connection_lost(self, exc) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        self.header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_late)

    def _headers_late(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_limits() -> dict:
    """uvicorn.Config's settings for the bounds above."""
    return {"http": BoundedH11Protocol, "timeout_keep_alive": 5}
