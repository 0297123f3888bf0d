"""A hostile or careless client against one `phalanx serve` process (127.0.0.1, a tiny llama,
its key from --api-key-file, UTF-8): every bad request gets its 4xx and OpenAI's error body,
never a 500 or a traceback in the log, and the server keeps answering the rest.

- the key is checked on every /v1 route, /v1/models included; a UTF-8 key authenticates;
- bodies above --max-request-bytes get 413, with or without a Content-Length;
- JSON nested 100,000 deep, a lone surrogate, service_tier as a list, temperature 1e-300,
  top_p 1e-46: 400 naming the field; max_completion_tokens beside max_tokens wins (as vLLM);
- a client that closes mid-body, and connections that send half a header and stop (closed
  by the server after http_limits.HEADER_TIMEOUT_S);
- chat without max_tokens on a KV cache smaller than the model's context is answered, with
  as many tokens as the cache holds.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from phalanx.serve.http_limits import HEADER_TIMEOUT_S
from tests.hf_models import write_checkpoint
from tests.serve_server import ServeProcess

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

KEY = "clé-ü-🔑"
LIMIT = 4000
BLOCKS, BLOCK = 6, 8
"""48 positions of KV cache, under the tiny model's 128."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    key_file = folder / "key"
    key_file.write_text(KEY + "\n", encoding="utf-8")
    model = write_checkpoint(folder / "llama", "llama", vocab_size=256)  # bytes: any text is in the vocabulary
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    process = ServeProcess(model, "--api-key-file", str(key_file),
                           "--max-request-bytes", str(LIMIT), "--num-kv-blocks", str(BLOCKS), "--block-size", str(BLOCK),
                           "--shutdown-grace", "1")
    yield process
    process.stop()
    assert "Traceback" not in "".join(process.stderr), "".join(process.stderr)


def _request(server, path: str, body: bytes | None = None, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = b"Bearer " + key.encode()  # the UTF-8 bytes, as a client sends them
    request = urllib.request.Request(server.url + path, data=body, method="POST" if body is not None else "GET",
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _raw(server, data: bytes) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(data)
    return sock


def test_the_key_guards_every_v1_route_and_a_utf8_key_works(server):
    assert _request(server, "/v1/models", key=None)[0] == 401
    assert _request(server, "/v1/models", key="wrong")[0] == 401
    status, answer = _request(server, "/v1/models")
    assert status == 200 and answer["data"][0]["object"] == "model"
    status, answer = _request(server, "/v1/completions", json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode())
    assert status == 200 and answer["usage"]["completion_tokens"] == 2
    assert _request(server, "/health", key=None)[0] == 200  # not under /v1: a load balancer's probe needs no key


def test_a_body_past_the_limit_is_413(server):
    big = json.dumps({"prompt": "a" * LIMIT}).encode()
    status, answer = _request(server, "/v1/completions", big)
    assert status == 413 and "--max-request-bytes" in answer["error"]["message"]
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
    with _raw(server, head + b"\r\nTransfer-Encoding: chunked\r\n\r\n") as sock:  # no length up front
        sock.sendall(b"".join(b"%x\r\n%s\r\n" % (1000, b"a" * 1000) for _ in range(5)))
        assert b" 413 " in sock.recv(4096).split(b"\r\n")[0]


BAD = [
    ("deep JSON", b"[" * 100_000 + b"]" * 100_000, None),
    ("lone surrogate", b'{"prompt": "\\ud800abc", "max_tokens": 1}', None),
    ("service_tier list", json.dumps({"prompt": "a", "service_tier": ["priority"]}).encode(), "service_tier"),
    ("service_tier object", json.dumps({"prompt": "a", "service_tier": {"a": 1}}).encode(), "service_tier"),
    ("temperature 1e-300", json.dumps({"prompt": "a", "temperature": 1e-300}).encode(), "temperature"),
    ("top_p 1e-46", json.dumps({"prompt": "a", "top_p": 1e-46}).encode(), "top_p"),
]


@pytest.mark.parametrize("label, body, param", BAD, ids=[b[0] for b in BAD])
def test_bad_bodies_are_400(server, label, body, param):
    limit_free = len(body) <= LIMIT
    status, answer = _request(server, "/v1/completions", body)
    assert status == (400 if limit_free else 413), answer
    assert answer["error"]["param"] == param


def test_max_tokens_and_max_completion_tokens(server):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    # Both given: max_completion_tokens wins, as vLLM reads them (api_fields.py).
    status, answer = _request(server, "/v1/chat/completions",
                              json.dumps({**chat, "max_tokens": 2, "max_completion_tokens": 3}).encode())
    assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
    status, answer = _request(server, "/v1/chat/completions", json.dumps({**chat, "max_completion_tokens": 3}).encode())
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    # No max_tokens, a cache of 48 positions under a 128-position context: as many as the cache holds.
    status, answer = _request(server, "/v1/chat/completions", json.dumps({**chat, "temperature": 0}).encode())
    assert status == 200, answer
    usage = answer["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] - 1 <= BLOCKS * BLOCK


def test_a_client_closing_mid_body_and_half_headers(server):
    """Half-sent headers are closed by the server; a body cut short leaves no traceback (the
    fixture checks the log at the end); the server answers all along."""
    idle = [_raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-") for _ in range(20)]
    opened = time.monotonic()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
    _raw(server, head + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ").close()
    status, _ = _request(server, "/v1/completions", json.dumps({"prompt": [1], "max_tokens": 1}).encode())
    assert status == 200
    time.sleep(max(0.0, HEADER_TIMEOUT_S + 2 - (time.monotonic() - opened)))
    for sock in idle:
        sock.settimeout(5)
        assert sock.recv(100) == b""  # closed by the server
        sock.close()
    assert _request(server, "/v1/models")[0] == 200


def test_the_key_is_compared_in_constant_time(monkeypatch):
    """Issue 36: the key was compared with `!=`, whose time tells how many leading bytes matched.
    Every /v1 request's Authorization goes through `hmac.compare_digest`, as UTF-8 bytes."""
    import asyncio
    import hmac

    from phalanx.serve.http_limits import ApiKeyCheck

    real, compared, reached, sent = hmac.compare_digest, [], [], []
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    check = ApiKeyCheck(app, KEY)
    for given in (b"Bearer " + KEY.encode(), b"Bearer wrong"):
        asyncio.run(check({"type": "http", "path": "/v1/models", "headers": [(b"authorization", given)]}, None, send))
    assert compared == [(b"Bearer " + KEY.encode(), b"Bearer " + KEY.encode()), (b"Bearer wrong", b"Bearer " + KEY.encode())]
    assert reached == ["/v1/models"] and sent[0]["status"] == 401
