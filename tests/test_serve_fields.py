"""The request fields `phalanx serve` honours as vLLM does, each against a reference computed
from `transformers`' own logits with the field's semantics, through a real server and the
`openai` client.

The checkpoint is a tiny llama whose end of turn is named only in `generation_config.json`
(as Qwen's and Llama 3's instruct checkpoints name theirs): the id its greedy continuation of
PROMPT emits at step 3, made a special token `<|im_end|>` of a word-level tokenizer. Greedy
answers are compared with the near-tie rule of serve_server.py (a difference only where the
reference's two best processed logits are within NEAR_TIE).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_models import write_checkpoint, write_word_tokenizer
from serve_server import NEAR_TIE, ServeProcess

VOCAB = 64
PROMPT = [5, 17, 3, 42, 8, 23]
OTHER = [9, 9, 31, 2]
NAME = "fields"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _hf(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _greedy_ids(model, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("fields") / "llama", "llama", vocab_size=VOCAB)
    steps = _greedy_ids(_hf(folder), PROMPT, 8)
    end = next(t for k, t in enumerate(steps) if k >= 2 and t not in steps[:k] and t not in PROMPT)
    write_word_tokenizer(folder, VOCAB, {"<|im_end|>": end})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [end]}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder, end


@pytest.fixture(scope="module")
def hf(model_dir):
    return _hf(model_dir[0])


@pytest.fixture(scope="module")
def client(model_dir):
    process = ServeProcess(model_dir[0], "--served-model-name", NAME, "--num-kv-blocks", "64", "--block-size", "8")
    yield process.client()
    process.stop()


def _reference(hf, prompt: list[int], new: int, *, ends=(), min_tokens=0, bias=None, repetition=1.0,
               frequency=0.0, presence=0.0) -> list[tuple[int, float]]:
    """Greedy ids with the fields' semantics applied to transformers' logits in plain Python,
    and the gap between the two best processed logits at each step."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            logits = hf(torch.tensor([ids])).logits[0, -1].tolist()
            generated = ids[len(prompt):]
            for token in range(len(logits)):
                count = generated.count(token)
                if count or token in prompt:
                    logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
                logits[token] -= frequency * count + presence * (count > 0)
                logits[token] += (bias or {}).get(token, 0.0)
                if len(generated) < min_tokens and token in ends:
                    logits[token] = -math.inf
            best = sorted(range(len(logits)), key=lambda t: -logits[t])[:2]
            out.append((best[0], logits[best[0]] - logits[best[1]]))
            ids.append(best[0])
            if best[0] in ends:
                break
    return out


def _assert_greedy(ours: list[int], reference: list[tuple[int, float]]) -> None:
    for step, (a, (b, gap)) in enumerate(zip(ours, reference)):
        if a != b:
            assert gap < NEAR_TIE, f"step {step}: served {a}, reference {b}, processed top-2 apart by {gap:.2e}"
            return
    assert len(ours) == len(reference), (ours, reference)


def _complete(client, prompt, **fields):
    extra = {"return_token_ids": True, **fields.pop("extra", {})}
    return client.completions.create(model=NAME, prompt=prompt, temperature=0, extra_body=extra, **fields)


def test_stops_on_the_end_of_turn_of_generation_config(client, model_dir, hf):
    """transformers.generate stops at generation_config.json's eos; so does the server, with
    finish_reason stop, the end-of-turn id counted and no special token in the text, in
    completions and in chat."""
    folder, end = model_dir
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                           do_sample=False, max_new_tokens=10, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert want[-1] == end and len(want) < 10, "the fixture's end of turn ends transformers' generation"
    choice = _complete(client, PROMPT, max_tokens=10).choices[0]
    assert choice.token_ids == want and choice.finish_reason == "stop"
    assert "<|im_end|>" not in choice.text and choice.text == " ".join(f"w{t}" for t in want[:-1])
    chat = client.chat.completions.create(model=NAME, temperature=0, max_tokens=10, messages=[
        {"role": "user", "content": " ".join(f"w{t}" for t in PROMPT)}])
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content == choice.text
    assert chat.usage.completion_tokens == len(want)
    raw = _complete(client, PROMPT, max_tokens=10, extra={"skip_special_tokens": False, "include_stop_str_in_output": True})
    assert raw.choices[0].text.endswith("<|im_end|>")


def test_ignore_eos_and_min_tokens(client, model_dir, hf):
    folder, end = model_dir
    plain = _complete(client, PROMPT, max_tokens=10, extra={"ignore_eos": True}).choices[0]
    assert plain.finish_reason == "length"
    _assert_greedy(plain.token_ids, _reference(hf, PROMPT, 10))
    held = _complete(client, PROMPT, max_tokens=12, extra={"min_tokens": 6}).choices[0]
    reference = _reference(hf, PROMPT, 12, ends={end}, min_tokens=6)
    _assert_greedy(held.token_ids, reference)
    assert len(held.token_ids) >= 6 and end not in held.token_ids[:6]


def test_stop_token_ids_and_max_completion_tokens(client, model_dir, hf):
    first = _complete(client, PROMPT, max_tokens=10, extra={"ignore_eos": True}).choices[0].token_ids
    stop = first[1]
    choice = _complete(client, PROMPT, max_tokens=10, extra={"stop_token_ids": [stop], "ignore_eos": True}).choices[0]
    assert choice.token_ids == first[:first.index(stop) + 1] and choice.finish_reason == "stop"
    assert choice.text == " ".join(f"w{t}" for t in choice.token_ids[:-1])
    kept = _complete(client, PROMPT, max_tokens=10, extra={"stop_token_ids": [stop], "ignore_eos": True,
                                                          "include_stop_str_in_output": True}).choices[0]
    assert kept.text == " ".join(f"w{t}" for t in kept.token_ids)
    both = _complete(client, PROMPT, max_tokens=2, extra={"max_completion_tokens": 5, "ignore_eos": True})
    assert both.usage.completion_tokens == 5


@pytest.mark.parametrize("fields", [
    dict(repetition=1.5),
    dict(frequency=0.8, presence=0.4),
    dict(bias={7: 2.5, 11: -100.0}, repetition=0.8),
])
def test_penalties_and_bias_equal_the_reference(client, hf, fields):
    names = {"repetition": "repetition_penalty", "frequency": "frequency_penalty", "presence": "presence_penalty"}
    extra = {names[k]: v for k, v in fields.items() if k in names}
    extra["ignore_eos"] = True
    kwargs = {}
    if "bias" in fields:
        kwargs["logit_bias"] = {str(k): v for k, v in fields["bias"].items()}
    choice = _complete(client, PROMPT, max_tokens=12, extra=extra, **kwargs).choices[0]
    _assert_greedy(choice.token_ids, _reference(hf, PROMPT, 12, **fields))


def test_n_and_a_list_of_prompts(client, hf):
    """Two prompts, n = 3: six choices numbered prompt x n + i, each prompt's three equal to
    its greedy answer alone; usage counts each prompt once."""
    answer = _complete(client, [PROMPT, OTHER], max_tokens=6, n=3, extra={"ignore_eos": True})
    assert [c.index for c in answer.choices] == list(range(6))
    for index, choice in enumerate(answer.choices):
        prompt = PROMPT if index < 3 else OTHER
        alone = _complete(client, prompt, max_tokens=6, extra={"ignore_eos": True}).choices[0]
        assert choice.token_ids == alone.token_ids and choice.prompt_token_ids == prompt
    assert answer.usage.prompt_tokens == len(PROMPT) + len(OTHER) and answer.usage.completion_tokens == 36


def test_seeded_choices_are_reproducible_and_stream_by_index(client):
    """Choice i of a request with seed s draws as a request of seed s + i does; streamed, each
    choice's pieces concatenate to its unstreamed text."""
    kwargs = dict(max_tokens=8, extra={"ignore_eos": True})
    sampled = dict(temperature=1.0, seed=40)
    both = client.completions.create(model=NAME, prompt=PROMPT, n=2, extra_body={"ignore_eos": True},
                                     max_tokens=8, **sampled)
    second = client.completions.create(model=NAME, prompt=PROMPT, extra_body={"ignore_eos": True},
                                       max_tokens=8, temperature=1.0, seed=41)
    assert both.choices[1].text == second.choices[0].text
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model=NAME, prompt=PROMPT, n=2, stream=True,
                                           extra_body=kwargs["extra"], max_tokens=8, **sampled):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: both.choices[0].text, 1: both.choices[1].text}


def test_best_of_answers_the_n_most_likely_candidates(client):
    """best_of 5, n 2, seed s: the candidates are the five choices of the same request with n 5
    (choice i draws with seed s + i), and the two answered are those of highest cumulative
    log-probability, best first; usage counts the answered tokens (as vLLM counts them)."""
    sampled = dict(model=NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    candidates = client.completions.create(n=5, logprobs=0, **sampled).choices
    ranked = sorted(candidates, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert len({c.text for c in candidates}) > 2, "the test needs candidates that differ"
    best = client.completions.create(n=2, best_of=5, **sampled)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] and [c.index for c in best.choices] == [0, 1]
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == 12


def test_twenty_logprobs(client):
    choice = _complete(client, PROMPT, max_tokens=2, logprobs=20, extra={"ignore_eos": True}).choices[0]
    assert all(len(top) == 20 for top in choice.logprobs.top_logprobs)
    chat = client.chat.completions.create(model=NAME, max_tokens=2, logprobs=True, top_logprobs=20,
                                          messages=[{"role": "user", "content": "w1 w2"}])
    assert all(len(entry.top_logprobs) == 20 for entry in chat.choices[0].logprobs.content)


def test_generation_config_fills_what_a_request_leaves_out(tmp_path):
    """`--generation-config auto`: the checkpoint's sampling settings for the fields a request
    does not give (its own win); `vllm`: none of them (the api's choice, without a server)."""
    from types import SimpleNamespace

    from phalanx.inference.generation_config import sampling_defaults
    from phalanx.serve.api import _sampling
    from phalanx.serve.api_requests import parse_completion

    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 1, "temperature": 0.6, "do_sample": True}))
    defaults = sampling_defaults(tmp_path)
    assert defaults == {"top_k": 1, "temperature": 0.6}
    state = SimpleNamespace(sampling_defaults=defaults, vocab_size=VOCAB)
    left_out = _sampling(parse_completion({"prompt": "a"}), state)
    assert (left_out.top_k, left_out.temperature) == (1, 0.6)
    given = _sampling(parse_completion({"prompt": "a", "temperature": 0.9}), state)
    assert (given.top_k, given.temperature) == (1, 0.9)
    assert _sampling(parse_completion({"prompt": "a"}), SimpleNamespace(sampling_defaults={}, vocab_size=VOCAB)).top_k == 0
