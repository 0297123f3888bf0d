"""Every route but /health and /metrics answers 503 with an OpenAI error body until the model
can serve, and again once the server can no longer serve (a rank lost): never a 200 from
/v1/models followed by a 503 from a completion.

The app runs on a real uvicorn server on 127.0.0.1, asked by the real `openai` client. The
engine loop is built but not started, so the model is "loading" for as long as the test
wants; setting its `ready` event is what the engine thread does once the model is in, and its
`failed` what it does when a rank dies (engine_loop.py), so the gate sees what a real server's
would. A whole server process cannot be held in its load from outside (the weights must be
regular files), hence this one test in-process.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

from phalanx.serve.api import ServeState, build_app
from phalanx.serve.engine_loop import EngineLoop

KEY = "sesame"
ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "a"}),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
          ("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [1]})]


@pytest.fixture
def loading():
    """(url, engine loop): a server whose model is still loading."""
    engine = EngineLoop(lambda: None, max_waiting=4, metrics=None, on_load_error=lambda error: None)
    state = ServeState("m", engine, codec=None, chat_template=None, metrics=None, max_len=64, vocab_size=8,
                       api_key=KEY)
    yield from _served(state)


def _served(state: ServeState):
    """The app of `state` on a real uvicorn server on 127.0.0.1 while the caller's fixture lasts."""
    engine = state.engine
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(timeout=10)


def _call(url: str, method: str, path: str, body, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + path, method=method, headers=headers,
                                     data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_is_503_while_loading(loading, method, path, body):
    url, _ = loading
    code, answer = _call(url, method, path, body)
    assert code == 503 and answer["error"]["code"] == "model_not_ready" and answer["error"]["type"] == "service_unavailable"
    assert _call(url, "GET", "/health", None) == (503, {"status": "loading"})


def test_the_key_is_checked_before_readiness(loading):
    url, _ = loading
    code, answer = _call(url, "GET", "/v1/models", None, key=None)
    assert code == 401 and answer["error"]["code"] == "invalid_api_key"


def test_openai_client_polling_models_sees_503_then_200(loading):
    url, engine = loading
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.models.list()
    assert refused.value.status_code == 503 and "loading" in refused.value.message
    engine.ready.set()  # what the engine thread does once the model is in
    assert [m.id for m in client.models.list().data] == ["m"]
    assert _call(url, "GET", "/health", None)[0] == 200


def test_a_server_that_can_no_longer_serve_says_why(loading):
    url, engine = loading
    engine.ready.set()
    engine.health.failed = "a rank of this server failed (rank 1 exited); retry shortly"
    for method, path, body in ROUTES:
        code, answer = _call(url, method, path, body)
        assert code == 503 and answer["error"]["code"] == "server_failed" and "rank 1 exited" in answer["error"]["message"]
    assert _call(url, "GET", "/health", None)[0] == 503


def test_a_prompt_being_tokenized_holds_no_other_request():
    """Issue 36: a 10 MB prompt was tokenized on the event loop and held every other request,
    /health included, for 39.5 s. Here the tokenizer blocks until the test releases it: while
    it does, /health and /v1/models answer at once (api.py tokenizes in a thread)."""
    entered, release = threading.Event(), threading.Event()

    class SlowCodec:
        def encode(self, text: str) -> list[int]:
            entered.set()
            release.wait(60)
            return []  # "encodes to no tokens": a 400 ends the request once released

        encode_special = encode

    engine = EngineLoop(lambda: None, max_waiting=4, metrics=None, on_load_error=lambda error: None)
    engine.ready.set()
    state = ServeState("m", engine, codec=SlowCodec(), chat_template=None, metrics=None, max_len=64, vocab_size=8,
                       api_key=KEY)
    served = _served(state)
    url, _ = next(served)
    try:
        answers: list = []
        slow = threading.Thread(target=lambda: answers.append(
            _call(url, "POST", "/v1/completions", {"prompt": "a long prompt", "max_tokens": 1})))
        slow.start()
        assert entered.wait(30), "the request never reached the tokenizer"
        began = time.monotonic()
        assert _call(url, "GET", "/health", None) == (200, {"status": "ok"})
        assert _call(url, "GET", "/v1/models", None)[0] == 200
        assert time.monotonic() - began < 10  # held, they would wait for the release (60 s)
        release.set()
        slow.join(30)
        assert answers and answers[0][0] == 400 and "no tokens" in answers[0][1]["error"]["message"]
    finally:
        release.set()
        next(served, None)
