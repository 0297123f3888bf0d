"""`phalanx serve` through HTTP with the real `openai` client, against one server process for
the module (a llama of 256 byte tokens, so text prompts encode with the byte tokenizer).

The server's cache is tiny on purpose (15 blocks of 8 positions: 3 of the 32 concurrent
requests at a time, fewer than the model's 128 positions), so the concurrent test also runs through preemption and recomputation.
Greedy ids are compared with `transformers` under the near-tie rule of tests/serve_server.py.
"""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.hf_models import write_checkpoint
from tests.serve_server import ServeProcess, assert_greedy_equal, transformers_greedy

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
KEY = "test-key"
NAME = "tiny-llama"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("serve") / "llama", "llama", vocab_size=256)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def server(model_dir):
    process = ServeProcess(model_dir, "--served-model-name", NAME, "--api-key", KEY, "--num-kv-blocks", "15",
                           "--block-size", "8", "--max-num-batched-tokens", "64", "--shutdown-grace", "1")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(KEY)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 25, (count,), generator=generator).tolist()
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


def test_concurrent_greedy_equals_transformers_through_preemption(server, client, model_dir):
    """32 concurrent greedy completions of 12 tokens, prompts of 4-24 ids, each equal to
    transformers' greedy generation of its prompt; 15 blocks cannot hold them all, so some are
    preempted and recomputed on the way (seen in /metrics)."""
    prompts, new = _prompts(32), 12

    def complete(prompt):
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=new, temperature=0,
                                         extra_body={"return_token_ids": True})

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(complete, prompts))
    for prompt, answer, (reference, logits) in zip(prompts, answers, transformers_greedy(model_dir, prompts, new)):
        choice = answer.choices[0]
        assert choice.prompt_token_ids == prompt and choice.finish_reason == "length"
        assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == new
        assert_greedy_equal(choice.token_ids, reference, logits)
    assert server.metrics()["phalanx_preemptions_total"] > 0
    assert len({tuple(a.choices[0].token_ids) for a in answers}) > 16, "distinct prompts, distinct continuations"


def test_unstreamed_answers_outlast_the_disconnect_poll(client):
    """24 unstreamed completions of 100 tokens on the 15-block cache (one at a time: each needs
    all of it) wait on each other for longer than DISCONNECT_POLL_S, the interval at which the
    handler looks whether its client hung up: each still gets its whole answer (the engine
    request's local name once shadowed the HTTP request's, and every such wait was a 500)."""
    from phalanx.serve.api import DISCONNECT_POLL_S

    def complete(first: int):
        began = time.monotonic()
        answer = client.completions.create(model=NAME, prompt=[first] * 20, max_tokens=100, temperature=0,
                                           extra_body={"ignore_eos": True})
        return answer, time.monotonic() - began

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(complete, range(30, 54)))
    assert max(took for _, took in results) > DISCONNECT_POLL_S, "the test needs a wait longer than the poll"
    assert all(answer.usage.completion_tokens == 100 for answer, _ in results)


def test_streamed_equals_unstreamed_with_multibyte_text(client):
    """Sampled (seed 7, temperature 1) from a prompt of 2- and 3-byte characters over 256 byte
    tokens: the streamed pieces concatenate to the unstreamed text, which is the bytes of its
    token ids decoded; bytes >= 0x80 among them show partial characters were held back."""
    prompt = "naïve café — ✓ 日本"
    kwargs = dict(model=NAME, prompt=prompt, max_tokens=40, temperature=1.0, seed=7, extra_body={"return_token_ids": True})
    whole = client.completions.create(**kwargs).choices[0]
    pieces, ids = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        pieces.append(chunk.choices[0].text)
        ids += chunk.choices[0].token_ids
    assert ids == whole.token_ids
    assert "".join(pieces) == whole.text == bytes(whole.token_ids).decode("utf-8", errors="replace")
    assert any(token >= 0x80 for token in ids)


def test_stream_usage_and_chat(client):
    """Chat through the directory's chat_template.jinja: the prompt is the rendered template's
    bytes; the stream opens with the assistant role and ends with a usage chunk."""
    messages = [{"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                            extra_body={"return_token_ids": True})
    assert answer.choices[0].message.role == "assistant" and answer.object == "chat.completion"
    assert answer.choices[0].prompt_token_ids == list(b"<user>hi\n<assistant>")
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def _post(server, path: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


BAD = [
    ("malformed JSON", b"{prompt: 1", 400, None),
    ("no prompt", {"model": NAME, "max_tokens": 2}, 400, "prompt"),
    ("unknown model", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    ("beyond the positions", {"prompt": [1] * 100, "max_tokens": 29}, 400, "max_tokens"),
    ("negative max_tokens", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("absurd temperature", {"prompt": "a", "temperature": 1e9}, 400, "temperature"),
    ("top_p 0", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("n > 16", {"prompt": "a", "n": 17}, 400, "n"),
    ("logprobs > 20", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("temperature below 1e-6", {"prompt": "a", "temperature": 1e-300}, 400, "temperature"),
    ("top_p below 1e-6", {"prompt": "a", "top_p": 1e-46}, 400, "top_p"),
    ("presence_penalty beyond 2", {"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("repetition_penalty 0", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit_bias key not an id", {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("logit_bias beyond 100", {"prompt": "a", "logit_bias": {"3": 101}}, 400, "logit_bias"),
    ("logit_bias outside the vocabulary", {"prompt": "a", "logit_bias": {"999": 1}}, 400, "logit_bias"),
    ("stop_token_ids not ids", {"prompt": "a", "stop_token_ids": ["x"]}, 400, "stop_token_ids"),
    ("min_tokens above max_tokens", {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("best_of below n", {"prompt": "a", "n": 3, "best_of": 2}, 400, "best_of"),
    ("best_of above n streamed", {"prompt": "a", "best_of": 3, "stream": True}, 400, "best_of"),
    ("echo on chat", {"messages": [{"role": "user", "content": "a"}], "echo": True}, 400, "echo"),
    ("tools", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ("an unknown field", {"prompt": "a", "temprature": 0.5}, 400, "temprature"),
    ("a second prompt beyond the positions", {"prompt": ["a", [1] * 100], "max_tokens": 29}, 400, "max_tokens"),
    ("id outside the vocabulary", {"prompt": [1, 999]}, 400, "prompt"),
    ("more blocks than the cache", {"prompt": [1] * 100, "max_tokens": 28}, 400, "max_tokens"),
    ("empty messages", {"messages": []}, 400, "messages"),
]


@pytest.mark.parametrize("label, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_their_4xx(server, label, body, status, param):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    code, answer = _post(server, path, body if isinstance(body, bytes) else json.dumps(body).encode())
    assert code == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["param"] == param


def test_api_key_and_server_still_answers(server, client):
    code, answer = _post(server, "/v1/completions", json.dumps({"prompt": "a"}).encode(), key=None)
    assert code == 401 and answer["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").completions.create(model=NAME, prompt="a", max_tokens=1)
    assert client.completions.create(model=NAME, prompt="still here", max_tokens=2).usage.completion_tokens == 2
    assert [m.id for m in client.models.list().data] == [NAME]


def test_disconnect_mid_stream_frees_blocks(server):
    """Read two chunks of a 100-token stream, hang up: the server aborts the sequence and its
    blocks are free again (running 0, no block used, one more request ended by abort).

    The tiny model can write all 100 tokens before the hang-up reaches the engine (it is
    noticed at the stream's next send); such a try ends by "length", and the test tries again,
    up to five times: what it checks is that a disconnect the server notices aborts."""
    abort, length = ('phalanx_requests_finished_total{finish_reason="%s"}' % reason for reason in ("abort", "length"))
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": NAME, "prompt": [3] * 20, "max_tokens": 100, "stream": True, "temperature": 0})
    for _ in range(5):
        before = server.metrics()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
            received = b""
            while received.count(b"data: ") < 2:
                received += sock.recv(4096)
        for _ in range(600):
            samples = server.metrics()
            ended = [samples.get(key, 0) - before.get(key, 0) for key in (abort, length)]
            if any(ended):
                break
            time.sleep(0.1)
        assert any(ended), "the request neither aborted nor finished within 60 s"
        if ended[0]:
            break
    assert ended == [1, 0], ended
    assert samples["phalanx_kv_blocks_used"] == 0 and samples["phalanx_requests_running"] == 0


def test_shared_prefix_hits_the_prefix_cache(server, client):
    """Two prompts sharing their first 33 ids, one after the other: the second finds the 4 full
    blocks of 8 of the first (32 tokens) in the prefix cache."""
    shared = list(range(100, 133))
    before = server.metrics()["phalanx_prefix_cache_hits_total"]
    client.completions.create(model=NAME, prompt=shared + [1, 2], max_tokens=1)
    client.completions.create(model=NAME, prompt=shared + [7], max_tokens=1)
    assert server.metrics()["phalanx_prefix_cache_hits_total"] - before == 32


def test_sigterm_with_requests_in_flight(server, client):
    """Last in the module: SIGTERM while two 40-token streams run. New requests are refused,
    every stream ends (finished, or with the shutdown's error chunk after the 1 s grace), and
    the server exits 0."""
    streams = [client.completions.create(model=NAME, prompt=[5 + i] * 8, max_tokens=40, temperature=0, stream=True)
               for i in range(2)]
    firsts = [next(iter(stream)) for stream in streams]  # both running
    assert all(first.choices for first in firsts)
    server.signal(signal.SIGTERM)

    def drain(stream):
        try:
            return [chunk.choices[0].finish_reason for chunk in stream if chunk.choices][-1]
        except openai.APIError as error:
            return str(error)

    with ThreadPoolExecutor(2) as pool:
        ends = list(pool.map(drain, streams))
    assert all(end == "length" or "shut down" in end for end in ends), ends
    assert server.process.wait(60) == 0
    with pytest.raises(openai.APIConnectionError):
        client.completions.create(model=NAME, prompt="late", max_tokens=1)
