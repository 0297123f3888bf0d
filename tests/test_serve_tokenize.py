"""vLLM's /tokenize and /detokenize, and `add_special_tokens` on the completion routes, against
a real server whose tokenizer adds a BOS (a post-processor, as Llama's tokenizer.json has).

A text prompt's ids are what `transformers`' `tokenizer(text)` gives (with the BOS) unless the
request says `add_special_tokens: false`, as vLLM reads it; /tokenize answers the very ids the
completion then feeds (compared through `return_token_ids`), and the greedy continuation of
them equals `transformers`' (serve_server.py's near-tie rule)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from hf_models import write_checkpoint, write_word_tokenizer
from serve_server import ServeProcess, assert_greedy_equal, transformers_greedy

VOCAB = 64
BOS = 1
NAME = "tok"
TEXT = "w5 w17 w3 w42"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("tokenize") / "llama", "llama", vocab_size=VOCAB)
    write_word_tokenizer(folder, VOCAB, {"<s>": BOS}, bos="<s>")
    return folder


TEMPLATE = "{{ lead | default('w9') }}{% for m in messages %} {{ m.content }}{% endfor %}"
"""--chat-template's file: a variable that chat_template_kwargs sets, else w9."""


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    process = ServeProcess(model_dir, "--served-model-name", NAME, "--num-kv-blocks", "32", "--block-size", "8",
                           "--chat-template", str(template))
    yield process
    process.stop()


def test_tokenize_gives_the_ids_a_completion_feeds(server, model_dir):
    words = [5, 17, 3, 42]
    code, answer = server.post("/tokenize", {"model": NAME, "prompt": TEXT})
    assert code == 200 and answer == {"count": 5, "max_model_len": answer["max_model_len"], "tokens": [BOS, *words],
                                      "token_strs": None}
    assert answer["max_model_len"] > 5
    assert server.post("/tokenize", {"prompt": TEXT, "add_special_tokens": False})[1]["tokens"] == words
    client = server.client()
    done = client.completions.create(model=NAME, prompt=TEXT, max_tokens=6, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert done.choices[0].prompt_token_ids == [BOS, *words]
    [(reference, logits)] = transformers_greedy(model_dir, [[BOS, *words]], 6)
    assert_greedy_equal(done.choices[0].token_ids, reference, logits)
    plain = client.completions.create(model=NAME, prompt=TEXT, max_tokens=1, temperature=0,
                                      extra_body={"return_token_ids": True, "add_special_tokens": False})
    assert plain.choices[0].prompt_token_ids == words


def test_chat_form_matches_the_chat_route(server):
    """--chat-template's file renders both; chat_template_kwargs sets its variable in both."""
    messages = [{"role": "user", "content": TEXT}]
    code, answer = server.post("/tokenize", {"messages": messages})
    chat = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=1,
                                                   extra_body={"return_token_ids": True})
    assert code == 200 and answer["tokens"] == chat.choices[0].prompt_token_ids == [9, 5, 17, 3, 42]
    assert server.post("/tokenize", {"messages": messages, "add_special_tokens": True})[1]["tokens"][0] == BOS
    lead = {"chat_template_kwargs": {"lead": "w7 w8"}}
    chat = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=1,
                                                   extra_body={"return_token_ids": True, **lead})
    assert chat.choices[0].prompt_token_ids == [7, 8, 5, 17, 3, 42]
    assert server.post("/tokenize", {"messages": messages, **lead})[1]["tokens"] == [7, 8, 5, 17, 3, 42]


@pytest.mark.parametrize("kwargs", [["x"], {"messages": []}, {"add_generation_prompt": False}])
def test_chat_template_kwargs_cannot_replace_the_request(server, kwargs):
    body = {"model": NAME, "messages": [{"role": "user", "content": TEXT}], "chat_template_kwargs": kwargs}
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400 and json.loads(refused.value.read())["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("content, problem", [(None, "No such file"), ("{% for %}", "does not compile")])
def test_a_bad_chat_template_file_is_one_line_before_loading(model_dir, tmp_path, content, problem):
    path = tmp_path / "chat.jinja"
    if content is not None:
        path.write_text(content)
    done = subprocess.run([sys.executable, "-m", "phalanx", "serve", "--model", str(model_dir), "--chat-template",
                           str(path)], capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.startswith("phalanx: error:")]
    assert done.returncode == 2 and len(lines) == 1 and problem in lines[0] and str(path) in lines[0], done.stderr


def test_detokenize_keeps_special_tokens(server):
    assert server.post("/detokenize", {"model": NAME, "tokens": [BOS, 5, 17]}) == (200, {"prompt": "<s> w5 w17"})
    assert server.post("/detokenize", {"tokens": []}) == (200, {"prompt": ""})


BAD = [
    ("/tokenize", {"prompt": TEXT, "temperature": 0}, 400, "temperature"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": TEXT, "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": TEXT, "return_token_strs": True}, 400, "return_token_strs"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False}, 400,
     "add_generation_prompt"),
    ("/tokenize", {"model": "gpt-9", "prompt": TEXT}, 404, "model"),
    ("/tokenize", [TEXT], 400, None),
    ("/detokenize", {"tokens": [1, "w"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [VOCAB]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"prompt": TEXT}, 400, "prompt"),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{b[0]} {json.dumps(b[1])}" for b in BAD])
def test_bad_bodies_are_refused_naming_the_field(server, path, body, status, param):
    code, answer = server.post(path, body)
    assert code == status and answer["error"]["param"] == param, answer
    assert server.status("/health") == 200
