"""`echo` and `prompt_logprobs` on /v1/completions: the prompt's own tokens scored, as
lm-evaluation-harness's `local-completions` model asks for them (`echo: true, logprobs: 1,
max_tokens: 1`, a batch of token-id prompts) to rank multiple-choice answers and to measure
perplexity.

Each prompt token's log-probability is compared with `transformers`' log-softmax of the same
checkpoint's logits at the position before it, within 1e-4: both are float32 forwards of the
same weights, whose logits here differ by about 1e-6 (serve_server.py), far below what a
log-probability rounding would show. The server runs with a step budget of 8 tokens and blocks
of 4 positions, so a prompt of 21 tokens is computed in three chunks over three steps, and the
same prompt sent first without scoring puts its blocks in the prefix cache, which a scored
prompt must not use (its positions' logits would never be computed).
"""

from __future__ import annotations

import pytest
import torch

from hf_models import write_checkpoint, write_word_tokenizer
from serve_server import ServeProcess

VOCAB = 64
PROMPT = [5, 17, 3, 42, 8, 23, 9, 9, 31, 2, 60, 14, 14, 7, 33, 50, 1, 12, 41, 27, 6]
OTHER = [9, 31, 2, 60, 14]
NAME = "echo"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("echo") / "llama", "llama", vocab_size=VOCAB)
    write_word_tokenizer(folder, VOCAB)
    return folder


@pytest.fixture(scope="module")
def scores(model_dir):
    """transformers' log-softmax over the vocabulary at every position of each prompt."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return {tuple(p): torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in (PROMPT, OTHER)}


@pytest.fixture(scope="module")
def server(model_dir):
    process = ServeProcess(model_dir, "--served-model-name", NAME, "--num-kv-blocks", "64", "--block-size", "4",
                           "--max-num-batched-tokens", "8")
    yield process
    process.stop()


def _expected(scores, prompt: list[int]) -> list[float]:
    rows = scores[tuple(prompt)]
    return [rows[p - 1, prompt[p]].item() for p in range(1, len(prompt))]


def test_echo_scores_every_prompt_token_after_a_cached_prefix(server, scores):
    client = server.client()
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, temperature=0)  # its blocks now cached
    again = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 20  # 5 whole blocks of 4; the 21st is computed
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2)
    assert answer.usage.prompt_tokens_details.cached_tokens == 0  # a scored prompt is computed whole
    choice = answer.choices[0]
    words = " ".join(f"w{t}" for t in PROMPT)
    assert choice.text.startswith(words) and len(choice.text) > len(words)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(PROMPT) + 1 and logprobs.tokens[:3] == ["w5", "w17", "w3"]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    got = logprobs.token_logprobs[1:len(PROMPT)]
    assert got == pytest.approx(_expected(scores, PROMPT), abs=TOLERANCE)
    rows = scores[tuple(PROMPT)]
    for p in range(1, len(PROMPT)):
        best = rows[p - 1].topk(2)
        top = logprobs.top_logprobs[p]
        assert len(top) == 2 and max(top.values()) == pytest.approx(best.values[0].item(), abs=TOLERANCE)
        assert f"w{best.indices[0].item()}" in top
    assert answer.usage.prompt_tokens == len(PROMPT) and answer.usage.completion_tokens == 1


def test_prompt_logprobs_give_rank_and_alternatives(server, scores):
    answer = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=1, temperature=0,
                                                extra_body={"prompt_logprobs": 3})
    entries = answer.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT)
    rows = scores[tuple(PROMPT)]
    for p in range(1, len(PROMPT)):
        mine = entries[p][str(PROMPT[p])]
        assert mine["logprob"] == pytest.approx(rows[p - 1, PROMPT[p]].item(), abs=TOLERANCE)
        assert mine["rank"] == int((rows[p - 1] > rows[p - 1, PROMPT[p]]).sum()) + 1
        assert mine["decoded_token"] == f"w{PROMPT[p]}"
        top3 = rows[p - 1].topk(3).indices.tolist()
        assert set(entries[p]) == {str(t) for t in top3} | {str(PROMPT[p])}
    assert not answer.choices[0].text.startswith("w5 w17")  # no echo asked


def test_a_batch_as_lm_evaluation_harness_sends_it(server, scores):
    """Two token-id prompts, echo, logprobs 1, max_tokens 1, greedy: each choice's prompt
    scores equal the reference, and a streamed answer says the same."""
    client = server.client()
    answer = client.completions.create(model=NAME, prompt=[PROMPT, OTHER], max_tokens=1, temperature=0, echo=True,
                                       logprobs=1)
    assert [c.index for c in answer.choices] == [0, 1]
    for choice, prompt in zip(answer.choices, (PROMPT, OTHER)):
        assert choice.logprobs.token_logprobs[1:len(prompt)] == pytest.approx(_expected(scores, prompt), abs=TOLERANCE)
    alone = client.completions.create(model=NAME, prompt=OTHER, max_tokens=1, temperature=0, echo=True, logprobs=1)
    assert alone.choices[0].text == answer.choices[1].text
    texts, scored = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.completions.create(model=NAME, prompt=[PROMPT, OTHER], max_tokens=1, temperature=0,
                                           echo=True, logprobs=1, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            scored[choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
    assert texts == {0: answer.choices[0].text, 1: answer.choices[1].text}
    assert scored[1][1:len(OTHER)] == pytest.approx(_expected(scores, OTHER), abs=TOLERANCE)


def test_echo_without_logprobs_is_text_alone(server):
    answer = server.client().completions.create(model=NAME, prompt="w5 w17 w3", max_tokens=2, temperature=0, echo=True)
    assert answer.choices[0].text.startswith("w5 w17 w3") and answer.choices[0].logprobs is None


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "w1", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "w1", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "w1", "prompt_logprobs": "3"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "w1", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_bad_echo_fields_are_400_naming_the_field(server, path, body, param):
    status, answer = server.post(path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert server.post("/v1/completions", {"prompt": "w1", "max_tokens": 1})[0] == 200  # and it keeps serving
