"""serve_load.py's HTTP client: one streamed /v1/completions request on its own HTTP/1.1
connection (h11, which uvicorn itself parses with), each server-sent event timed as it arrives.

A lean client rather than the `openai` package's: the load runs on the same two cores as the
server, and the `openai` client (pydantic models per chunk, its own HTTP stack) spent several
times the CPU of this one per streamed chunk, taken from the server it measures (serve_load.py
prints the client's CPU seconds); vLLM's `benchmark_serving.py` parses the stream itself for
the same reason. What
is counted is what the `openai` client yields: every `data:` event but the final `[DONE]`, an
error event raising. The tests check the API with the real `openai` client
(tests/test_serve_http.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

import h11


class Refused(Exception):
    """The server answered 429 (its waiting queue is full, or a TTFT target cannot be met)."""


async def _response(url: str, body: dict):
    """`body` POSTed to `url`/v1/completions on a new connection; yields ("status", code), then
    ("data", bytes) as the body arrives, then ("end", None)."""
    where = urlsplit(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    connection = h11.Connection(h11.CLIENT)
    data = json.dumps(body).encode()
    headers = [("Host", where.netloc), ("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
    writer.write(connection.send(h11.Request(method="POST", target="/v1/completions", headers=headers))
                 + connection.send(h11.Data(data=data)) + connection.send(h11.EndOfMessage()))
    try:
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Response):
                yield "status", event.status_code
            elif isinstance(event, h11.Data):
                yield "data", event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                yield "end", None
                return
    finally:
        writer.close()


async def stream_times(url: str, body: dict) -> list[float]:
    """POST `body` (with "stream": true) to `url`/v1/completions; the perf_counter time at which
    each streamed chunk arrived."""
    times: list[float] = []
    pending, status = b"", 0
    async for kind, value in _response(url, body):
        if kind == "status":
            status = value
        elif kind == "data":
            pending += value
            *events, pending = pending.split(b"\n\n")  # an event ends with a blank line
            now = time.perf_counter()
            for text in events:
                if status != 200:
                    raise Refused(text.decode()) if status == 429 else RuntimeError(f"HTTP {status}: {text!r}")
                if text.startswith(b"data: ") and text != b"data: [DONE]":
                    if b'"error"' in text and "error" in json.loads(text[6:]):
                        raise RuntimeError(f"the stream ended with an error: {text!r}")
                    times.append(now)
        elif status == 429:
            raise Refused(pending.decode())
        elif status != 200:
            raise RuntimeError(f"HTTP {status}: {pending!r}")
    return times


async def completion_tokens(url: str, body: dict) -> int:
    """POST `body` (unstreamed) to `url`/v1/completions; the completion tokens of its answer."""
    answer, status = b"", 0
    async for kind, value in _response(url, body):
        if kind == "status":
            status = value
        elif kind == "data":
            answer += value
        elif status != 200:
            raise RuntimeError(f"HTTP {status}: {answer!r}")
    return json.loads(answer)["usage"]["completion_tokens"]
