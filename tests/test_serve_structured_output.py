"""Structured output on a real `phalanx serve` with the `openai` client, as users ask for it:
`response_format` (json_object, json_schema), vLLM's `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` and `structured_outputs`, on /v1/chat/completions and
/v1/completions.

The model is a random tiny llama, so what it would write unconstrained is noise: an answer
that parses and validates against its schema, fullmatches its regex or is one of its choices
is the grammar's doing. Schemas here are bounded (a string's maxLength, an integer's range)
so that greedy answers end within max_tokens: a random model never chooses to close a string.
One server has a byte-level BPE tokenizer with an end-of-text token (the grammar ends on it);
the other the byte tokenizer, which has none (the answer ends as soon as its grammar can).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
import torch

from hf_models import write_checkpoint
from phalanx.inference.grammar import Constraint, Grammars, Vocabulary
from phalanx.inference.sampling import Row, Sampling, sample
from serve_server import ServeProcess

VOCAB = 320
NAME = "structured"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green"]},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["red", "green", "blue", "dark blue"]
CORPUS = ['{"name": "Ada", "age": 36, "ok": true}', "the quick brown fox jumps over the lazy dog", "red green blue"] * 20


def _bpe_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 10, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return tok


TEMPLATE = ("{% if tools %}You may call {{ tools | map(attribute='function.name') | join(', ') }} as "
            "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
"""A chat template that shows Hermes' tool-call format, as Qwen's does (tool_choice auto reads it)."""


def _model_with_template(tmp_path_factory, name: str, template: str) -> Path:
    """The tiny llama with the byte-level BPE tokenizer and `template` as its chat template."""
    folder = write_checkpoint(tmp_path_factory.mktemp(name) / "llama", "llama", vocab_size=VOCAB,
                              max_position_embeddings=512)
    _bpe_tokenizer(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _model_with_template(tmp_path_factory, "structured", TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir):
    process = ServeProcess(model_dir, "--served-model-name", NAME, "--num-kv-blocks", "128")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_masks_in_a_batch_change_only_their_rows():
    """The batch sampler: each constrained row keeps only what its grammar allows, the rows
    beside it (and the caller's logits) are untouched, and a grammar that allows only its end
    wins over min_tokens' ban of that end."""
    end = 256
    grammars = Grammars(Vocabulary(None, 260, frozenset({end})))
    digit = grammars.matcher(grammars.compile(Constraint("regex", "[0-9]")), frozenset({end}))
    yes = grammars.matcher(grammars.compile(Constraint("choice", json.dumps(["yes"]))), frozenset({end}))
    logits = torch.randn(3, 260, generator=torch.Generator().manual_seed(0))
    logits[:, ord("a")] = 50.0  # the unconstrained choice of every row
    before = logits.clone()
    greedy = Sampling(greedy=True)
    tokens = sample(logits, [Row(greedy, grammar=digit), Row(greedy), Row(greedy, grammar=yes)])
    assert torch.equal(logits, before)
    assert chr(tokens[0]) in "0123456789" and tokens[0] == 48 + logits[0, 48:58].argmax().item()
    assert tokens[1] == ord("a") and tokens[2] == ord("y")
    assert digit.accept(tokens[0]) and not digit.terminated  # complete, but its end is the model's to take
    assert sample(logits[:1], [Row(greedy, grammar=digit, banned=frozenset({end}))]) == [end]
    assert digit.accept(end) and digit.terminated


def _valid(answer: dict, schema: dict) -> None:
    import jsonschema

    jsonschema.validate(answer, schema)


def test_json_schema_on_chat_parses_and_validates(client):
    for seed in range(3):
        answer = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"who? {seed}"}], max_tokens=80, temperature=0.8,
            seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                                 "strict": True}})
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        _valid(json.loads(choice.message.content), SCHEMA)


def test_guided_json_and_structured_outputs_on_completions(client):
    for extra in ({"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)}, {"structured_outputs": {"json": SCHEMA}}):
        choice = client.completions.create(model=NAME, prompt="the quick", max_tokens=80, temperature=0,
                                           extra_body=extra).choices[0]
        assert choice.finish_reason == "stop", (extra, choice)
        _valid(json.loads(choice.text), SCHEMA)


def test_json_object(client, model_dir):
    from tokenizers import Tokenizer

    close = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id("}")
    # A random model never closes the object of its own accord: a bias makes `}` its choice
    # wherever the grammar allows it (the mask comes first, so the bias adds nothing elsewhere).
    answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "json"}], max_tokens=20,
                                            temperature=0, response_format={"type": "json_object"},
                                            logit_bias={str(close): 100})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and json.loads(choice.message.content) == {}
    streamed = client.completions.create(model=NAME, prompt="x", max_tokens=20, temperature=0, stream=True,
                                         logit_bias={str(close): 100},
                                         extra_body={"structured_outputs": {"json_object": True,
                                                                            "disable_any_whitespace": True}})
    chunks = list(streamed)
    assert json.loads("".join(c.choices[0].text for c in chunks)) == {} and chunks[-1].choices[0].finish_reason == "stop"


def test_regex_and_choice_and_grammar(client):
    for seed in range(4):
        text = client.completions.create(model=NAME, prompt="code:", max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"guided_regex": REGEX}).choices[0]
        assert re.fullmatch(REGEX, text.text) and text.finish_reason == "stop", text
        choice = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "color?"}],
                                                max_tokens=16, temperature=1.0, seed=seed,
                                                extra_body={"guided_choice": CHOICES}).choices[0]
        assert choice.message.content in CHOICES and choice.finish_reason == "stop", choice
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    text = client.completions.create(model=NAME, prompt="ok?", max_tokens=8, temperature=0,
                                     extra_body={"structured_outputs": {"grammar": grammar}}).choices[0].text
    assert re.fullmatch(r"yes|no|maybe [0-9]", text), text


def test_min_tokens_gives_way_to_the_grammars_end(client):
    choice = client.completions.create(model=NAME, prompt="x", max_tokens=20, temperature=0,
                                       extra_body={"guided_choice": ["ok"], "min_tokens": 10}).choices[0]
    assert choice.text == "ok" and choice.finish_reason == "stop"


def test_n_choices_each_follow_the_grammar(client):
    answer = client.completions.create(model=NAME, prompt=["a", "b"], max_tokens=16, temperature=1.0, n=3, seed=7,
                                       extra_body={"guided_regex": REGEX})
    assert len(answer.choices) == 6 and all(re.fullmatch(REGEX, c.text) for c in answer.choices)


def test_a_grammar_that_allows_everything_changes_nothing(client, model_dir):
    """Greedy with a regex every text matches equals greedy without one, token for token. The
    random model's single bytes of multi-byte characters (which no text regex allows alone)
    are biased away in both requests alike."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    partial = {str(i): -100 for i in range(tok.get_vocab_size()) if "\ufffd" in tok.decode([i])}
    asked = dict(model=NAME, prompt="the quick brown", max_tokens=24, temperature=0, logit_bias=partial)
    plain = client.completions.create(**asked, extra_body={"return_token_ids": True}).choices[0]
    free = client.completions.create(**asked, extra_body={"return_token_ids": True,
                                                          "guided_regex": r"[\s\S]*"}).choices[0]
    assert free.token_ids == plain.token_ids and free.text == plain.text


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_regex": "a(("}, "guided_regex"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_grammar": 'root ::= "a" | '}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),  # and no constraint
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_constraints_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt="x", max_tokens=4, extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body
    # ... and the server goes on serving, structured output too.
    assert client.completions.create(model=NAME, prompt="x", max_tokens=4, temperature=0,
                                     extra_body={"guided_choice": ["ok"]}).choices[0].text == "ok"


@pytest.fixture(scope="module")
def byte_server(tmp_path_factory):
    """The byte tokenizer, and no chat template (the plain fallback, which shows no tool-call format)."""
    folder = write_checkpoint(tmp_path_factory.mktemp("bytes") / "llama", "llama", vocab_size=VOCAB)
    # 12 blocks of 16 positions: four answers of up to 100 tokens at once do not fit, so some are preempted.
    process = ServeProcess(folder, "--served-model-name", NAME, "--num-kv-blocks", "12", "--tokenizer", "bytes")
    yield process
    process.stop()


def test_without_an_end_token_the_answer_ends_with_its_grammar(byte_server):
    """The byte tokenizer has no end-of-sequence id: the answer stops where the grammar is
    complete. Four at once on a pool too small for them: a preempted sequence keeps its place
    in its grammar while its context is recomputed."""
    from concurrent.futures import ThreadPoolExecutor

    client = byte_server.client()

    def ask(seed: int):
        return client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "who?"}], max_tokens=100, temperature=0.8, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}).choices[0]

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(ask, range(4)))
    for choice in choices:
        assert choice.finish_reason == "stop"
        _valid(json.loads(choice.message.content), SCHEMA)
    assert byte_server.metrics()["phalanx_preemptions_total"] > 0
    choice = client.completions.create(model=NAME, prompt="x", max_tokens=16, temperature=0,
                                       extra_body={"guided_choice": CHOICES}).choices[0]
    assert choice.text in CHOICES and choice.finish_reason == "stop"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"]}}}


def _weather_args(arguments: str) -> None:
    _valid(json.loads(arguments), WEATHER["function"]["parameters"])


def test_named_tool_call(client):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    for seed in range(2):
        answer = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                temperature=0.8, seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        call, = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        _weather_args(call.function.arguments)
    streamed = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=60,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                              temperature=0, stream=True)
    deltas = [chunk.choices[0] for chunk in streamed if chunk.choices]
    calls = [call for d in deltas for call in (d.delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and deltas[-1].finish_reason == "tool_calls"
    _weather_args(calls[0].function.arguments)


def test_required_tool_calls(client):
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    for seed, parallel in ((0, None), (1, False), (2, True)):
        answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "now?"}],
                                                tools=[WEATHER, TIME], tool_choice="required", max_tokens=300,
                                                temperature=0.8, seed=seed, parallel_tool_calls=parallel)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls and (parallel is not False or len(calls) == 1)
        for call in calls:
            _valid(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_none_answers_in_text(client):
    choice = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                            tool_choice="none", max_tokens=5, temperature=0).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
])
def test_bad_tools_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_parsed_from_the_models_hermes_text(client, stream):
    """Under auto the model chooses; a random one never calls, so a regex makes it write a
    Hermes call after some content, which must come back as content and tool_calls."""
    asked = dict(model=NAME, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER, TIME], max_tokens=80,
                 temperature=0, extra_body={"guided_regex": "Let me look[.]\n" + re.escape(CALL)})
    if stream:
        deltas = [chunk.choices[0] for chunk in client.chat.completions.create(**asked, stream=True) if chunk.choices]
        content = "".join(d.delta.content or "" for d in deltas)
        calls = [call for d in deltas for call in (d.delta.tool_calls or [])]
        finish = deltas[-1].finish_reason
    else:
        choice = client.chat.completions.create(**asked).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
    assert content.strip() == "Let me look." and finish == "tool_calls"
    call, = calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    plain = client.chat.completions.create(**{**asked, "extra_body": {"guided_regex": "no <tool_ call here"}})
    assert plain.choices[0].message.content == "no <tool_ call here" and plain.choices[0].message.tool_calls is None


def test_auto_is_refused_where_the_template_shows_no_tool_call_format(byte_server):
    for extra in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as caught:
            byte_server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=4, extra_body=extra)
        assert caught.value.body["param"] == "tool_choice" and "format" in caught.value.body["message"]


LLAMA3_TEMPLATE = (
    "{% if tools %}Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}. Do not use variables.\n\n"
    "{{ tools | map(attribute='function.name') | join(', ') }}\n\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
"""A chat template shaped like Meta's Llama 3.1-3.3 ones: it asks for JSON calls in their words
(naming the functions only, where theirs give each schema as JSON: the tiny model's context is short)."""
WEATHER_JSON = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
TIME_JSON = '{"name": "get_time", "arguments": {"zone": 2}}'


@pytest.mark.parametrize("text, calls", [
    (WEATHER_JSON, [("get_weather", {"city": "Paris", "unit": "c"})]),
    (f" {WEATHER_JSON} ;\n{TIME_JSON}\n", [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": 2})]),
    (f"<|python_tag|>{WEATHER_JSON}; {TIME_JSON}", [("get_weather", {"city": "Paris", "unit": "c"}),
                                                     ("get_time", {"zone": 2})]),
    ('{"name": "f", "parameters": "{\\"a\\": 1}"}', [("f", {"a": 1})]),  # arguments already as JSON text
    (f"Let me look. {WEATHER_JSON}", []),  # a call must be the whole answer
    (f"{WEATHER_JSON} and then", []),
    (f"{WEATHER_JSON}; ", []),
    (f"{WEATHER_JSON} {TIME_JSON}", []),  # not separated by ;
    ('{"name": "get_weather", "parameters": {"city": "Par', []),  # malformed (cut short)
    ('{"name": "Ada", "age": 36}', []),  # JSON, but no parameters: an answer, not a call
    ('{"name": 3, "parameters": {}}', []),
    ('[{"name": "f", "parameters": {}}]', []),
    ("<|python_tag|>print(1)", []),
    ("plain text", []),
    ("", []),
])
def test_llama3_json_parser(text, calls):
    from phalanx.serve import llama3_json_tool_calls

    content, parsed = llama3_json_tool_calls.parse(text)
    assert [(call.name, json.loads(call.arguments)) for call in parsed] == calls
    assert content == (None if calls else text)


def test_llama3_json_streaming_holds_back_only_what_may_be_a_call():
    from phalanx.serve.llama3_json_tool_calls import sendable

    for held in ("", "  \n", "{", '{"name": "get_we', "<|python", "<|python_tag|>{", '{"name": "Ada"} is'):
        assert sendable(held) == 0, held
    for text in ("Hello", "<b>x", " Sure {", "<|pythonic"):
        assert sendable(text) == len(text), text


def test_the_format_comes_from_the_template_or_the_flag(tmp_path):
    from phalanx.serve.chat_template import ChatTemplate
    from phalanx.serve.tool_call_parsers import PARSERS, detect

    assert (detect(TEMPLATE), detect(LLAMA3_TEMPLATE), detect("{{ messages }}"), detect(None)) == (
        "hermes", "llama3_json", None, None)
    assert set(PARSERS) == {"hermes", "llama3_json"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA3_TEMPLATE}))
    assert ChatTemplate(tmp_path).tool_call_format == "llama3_json"
    assert ChatTemplate(tmp_path, None, "hermes").tool_call_format == "hermes"
    assert ChatTemplate(None, None, "llama3_json").tool_call_format == "llama3_json"  # the plain fallback, told


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    return _model_with_template(tmp_path_factory, "llama3_tools", LLAMA3_TEMPLATE)


@pytest.fixture(scope="module")
def llama3_client(llama3_dir):
    process = ServeProcess(llama3_dir, "--served-model-name", NAME, "--num-kv-blocks", "128")
    yield process.client()
    process.stop()


def _auto(client, regex: str, stream: bool) -> tuple[str | None, list, str]:
    """(content, tool calls, finish_reason) of a tool_choice auto answer the regex makes the
    random model write, streamed or not."""
    asked = dict(model=NAME, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER, TIME],
                 max_tokens=160, temperature=0, extra_body={"guided_regex": regex})
    if not stream:
        choice = client.chat.completions.create(**asked).choices[0]
        return choice.message.content, choice.message.tool_calls or [], choice.finish_reason
    deltas = [chunk.choices[0] for chunk in client.chat.completions.create(**asked, stream=True) if chunk.choices]
    content = "".join(d.delta.content or "" for d in deltas)
    return content or None, [call for d in deltas for call in (d.delta.tool_calls or [])], deltas[-1].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_parsed_from_the_models_llama3_json(llama3_client, stream):
    """A template shaped like Llama 3's: under auto a regex makes the random model write two
    JSON calls behind <|python_tag|>, which come back as tool_calls without content; an answer
    that is not a call (text, or JSON without parameters, held back while streamed until it
    ends) comes back whole as content."""
    content, calls, finish = _auto(llama3_client, re.escape(f"<|python_tag|>{WEATHER_JSON}; {TIME_JSON}"), stream)
    assert content is None and finish == "tool_calls"
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": 2})]
    assert all(call.type == "function" and call.id.startswith("call_") for call in calls)
    assert [getattr(call, "index", i) for i, call in enumerate(calls)] == [0, 1]
    for text in ("no call here", '{"name": "Ada", "age": 36}'):
        content, calls, finish = _auto(llama3_client, re.escape(text), stream)
        assert (content, calls) == (text, []) and finish == "stop"


def test_tool_call_parser_flag_replaces_the_templates_format(llama3_dir):
    """--tool-call-parser hermes on a template that shows Llama 3's format: Hermes calls are read,
    Llama 3's JSON is text."""
    process = ServeProcess(llama3_dir, "--served-model-name", NAME, "--num-kv-blocks", "64",
                           "--tool-call-parser", "hermes")
    try:
        content, calls, finish = _auto(process.client(), re.escape(CALL), False)
        assert finish == "tool_calls" and [call.function.name for call in calls] == ["get_weather"]
        content, calls, finish = _auto(process.client(), re.escape(WEATHER_JSON), False)
        assert (content, calls) == (WEATHER_JSON, [])
    finally:
        process.stop()
