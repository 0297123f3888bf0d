"""Every route but /health and /metrics answers 503, with an OpenAI error body, until the model
can serve, and again once it no longer can (a rank lost).

Why not open the port only when ready, as vLLM and SGLang do: the port opens at once so that
/health can say "loading" (and then "failed", with the reason, if the load fails), which is
what supervisors and load balancers poll; clients that poll /v1/models (the OpenAI clients'
habit, and llama.cpp's server answers the same way) see 503 until a completion would succeed,
never a 200 followed by a 503. The key check runs first: a request without the key gets 401
whether or not the model is in.
"""

from __future__ import annotations

from phalanx.serve.api_requests import ApiError
from phalanx.serve.http_limits import send_error

OPEN_PATHS = ("/health", "/metrics")
"""Answer while loading: they report the server's state."""


class ReadinessGate:
    """ASGI middleware: 503 (code `model_not_ready`, or `server_failed`) on every other path
    while `engine.ready` is unset or `engine.failed` says why the server can no longer serve."""

    def __init__(self, app, engine):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.engine.failed:
            return await send_error(send, ApiError(503, f"this server can no longer serve: {self.engine.failed}",
                                                   code="server_failed"))
        if not self.engine.ready.is_set():
            return await send_error(send, ApiError(503, "the model is still loading; /health answers 200 once it "
                                                        "can serve", code="model_not_ready"))
        return await self.app(scope, receive, send)
