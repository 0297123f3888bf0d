"""/v1/responses (OpenAI's Responses API) against a real server with the real `openai` client:
the same tokens as the chat completion of the same messages (greedy, so any difference is the
translation's), whole and streamed (the SDK's own event types parse every event), and each
refusal of what needs stored state, with the field named."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from hf_models import write_checkpoint, write_word_tokenizer
from serve_server import ServeProcess

VOCAB = 64
NAME = "resp"
WORDS = "w5 w17 w3 w42 w8"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("responses") / "llama", "llama", vocab_size=VOCAB)
    write_word_tokenizer(folder, VOCAB)
    process = ServeProcess(folder, "--served-model-name", NAME, "--num-kv-blocks", "32", "--block-size", "8")
    yield process
    process.stop()


def _chat(client, messages, **fields):
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                          extra_body={"return_token_ids": True}, **fields).choices[0]


def test_a_response_is_the_chat_completion_of_its_messages(server):
    client = server.client()
    answer = client.responses.create(model=NAME, input=WORDS, instructions="w9 w9", max_output_tokens=6, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "w9 w9"}, {"role": "user", "content": WORDS}], max_tokens=6)
    assert answer.object == "response" and answer.id.startswith("resp_") and answer.model == NAME
    assert answer.output_text == chat.message.content and answer.output[0].role == "assistant"
    assert answer.usage.output_tokens == len(chat.token_ids) and answer.usage.input_tokens == len(chat.prompt_token_ids)
    assert answer.status == ("incomplete" if chat.finish_reason == "length" else "completed")
    if answer.status == "incomplete":
        assert answer.incomplete_details.reason == "max_output_tokens"


def test_message_items_and_roles(server):
    client = server.client()
    items = [{"role": "developer", "content": "w1"}, {"role": "user", "content": [{"type": "input_text", "text": "w2 w3"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "w4"}]}, {"role": "user", "content": "w5"}]
    answer = client.responses.create(model=NAME, input=items, max_output_tokens=4, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3"},
                          {"role": "assistant", "content": "w4"}, {"role": "user", "content": "w5"}], max_tokens=4)
    assert answer.output_text == chat.message.content


def test_streamed_events_add_up_to_the_whole(server):
    client = server.client()
    whole = client.responses.create(model=NAME, input=WORDS, max_output_tokens=8, temperature=0, top_logprobs=2)
    events = list(client.responses.create(model=NAME, input=WORDS, max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    logprobs = whole.output[0].content[0].logprobs
    assert len(logprobs) == whole.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert all(lp.logprob <= 0 for lp in logprobs)


BAD = [
    ({"input": WORDS, "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": WORDS, "store": True}, "store"),
    ({"input": WORDS, "background": True}, "background"),
    ({"input": WORDS, "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": WORDS, "max_tokens": 3}, "max_tokens"),
    ({"input": WORDS, "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": WORDS, "temperature": 3}, "temperature"),
    ({"input": WORDS, "instructions": 5}, "instructions"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({}, "input"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[b[1] for b in BAD])
def test_refusals_name_the_field(server, body, param):
    request = urllib.request.Request(server.url + "/v1/responses", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    answer = json.loads(refused.value.read())
    assert refused.value.code == 400 and answer["error"]["param"] == param, answer
    assert server.status("/health") == 200


def test_structured_output_with_a_tokenizer_that_names_no_end_of_text(server):
    """This server's tokenizer has no end-of-text token (xgrammar wants stop ids; its words
    cannot write JSON, so a choice of words): the answer is one of the choices and ends where
    its grammar does."""
    answer = server.client().completions.create(model=NAME, prompt=WORDS, max_tokens=10, temperature=0,
                                                extra_body={"guided_choice": ["w5 w6", "w7"]})
    assert answer.choices[0].text in ("w5 w6", "w7") and answer.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="no token of this model's vocabulary") as refused:
        server.client().completions.create(model=NAME, prompt=WORDS, max_tokens=10, temperature=0,
                                           extra_body={"guided_choice": ["red", "blue"]})  # words it cannot spell
    assert refused.value.body["param"] == "guided_choice"


def test_the_sdk_sees_a_refusal_as_a_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="stored"):
        server.client().responses.create(model=NAME, input=WORDS, previous_response_id="resp_1")
