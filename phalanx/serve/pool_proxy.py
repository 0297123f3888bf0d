"""Forwarding one HTTP request to a pool's engine on 127.0.0.1 and relaying its answer as it
comes (server-sent events piece by piece), on asyncio streams with h11 (uvicorn's own HTTP/1.1
parser, so nothing new is installed). One connection per request: closing it is how a client
that went away reaches the engine, which then aborts the sequence and frees its blocks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

import h11

READ_SIZE = 1 << 16
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length", "upgrade", "te", "trailer",
              "proxy-authorization", "proxy-connection"}


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: AsyncIterator[bytes]
    """The body as it comes; the connection closes when it ends or is closed."""


async def forward(address: tuple[str, int], method: str, path: str, headers: list[tuple[str, str]],
                  body: bytes = b"") -> Answer:
    host, port = address
    reader, writer = await asyncio.open_connection(host, port)
    connection = h11.Connection(h11.CLIENT)
    kept = [(name, value) for name, value in headers if name.lower() not in HOP_BY_HOP]
    request = h11.Request(method=method, target=path, headers=[("host", f"{host}:{port}"), ("connection", "close"),
                                                               ("content-length", str(len(body))), *kept])
    try:
        writer.write(connection.send(request) + connection.send(h11.Data(data=body)) +
                     connection.send(h11.EndOfMessage()))
        await writer.drain()
        event = await _next(connection, reader)
        while not isinstance(event, h11.Response):
            if isinstance(event, h11.ConnectionClosed):
                raise ConnectionError(f"the engine at {host}:{port} closed the connection without an answer")
            event = await _next(connection, reader)
    except BaseException:
        writer.close()
        raise
    answer_headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in event.headers
                      if name.decode("latin-1").lower() not in HOP_BY_HOP]
    return Answer(event.status_code, answer_headers, _body(connection, reader, writer))


async def _next(connection: h11.Connection, reader: asyncio.StreamReader):
    while True:
        event = connection.next_event()
        if event is not h11.NEED_DATA:
            return event
        connection.receive_data(await reader.read(READ_SIZE))


async def _body(connection: h11.Connection, reader, writer) -> AsyncIterator[bytes]:
    try:
        while True:
            event = await _next(connection, reader)
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return
    finally:
        writer.close()


async def read_all(answer: Answer) -> bytes:
    return b"".join([piece async for piece in answer.body])
