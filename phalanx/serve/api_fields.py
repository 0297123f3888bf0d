"""Every field of OpenAI's and vLLM's completion and chat request bodies, and what phalanx does
with it: one table that both the request checks (`api_requests.py`) and the table in
docs/serve.md come from (`python -m phalanx.serve.api_fields` prints it; a test compares).

A field is honoured (its value changes the answer as OpenAI or vLLM define it), accepted
without effect on the answer (`user`, `metadata`: labels), or refused: a value other than the
neutral ones is a 400 naming the field and the reason, never silently ignored. A field in
neither schema is refused too (as OpenAI answers "Unrecognized request argument").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from phalanx.inference.sampling_bounds import (LOGIT_BIAS_RANGE, MAX_REPETITION_PENALTY, MIN_TEMPERATURE, MIN_TOP_P,
                                               PENALTY_RANGE)

COMPLETIONS, CHAT, RESPONSES = "completions", "chat", "responses"
BOTH = "completions, chat"
ALL = "completions, chat, responses"
CHAT_RESPONSES = "chat, responses"


@dataclass(frozen=True)
class Field:
    name: str
    where: str
    """Which endpoints take it: completions, chat, responses, or several, comma-separated."""
    openai: bool
    vllm: bool
    phalanx: str
    """What phalanx does with it (the docs' column)."""
    refused: str | None = None
    """Why a value other than the neutral ones is refused (None: honoured or accepted)."""
    neutral: tuple = (None,)
    """Values that ask for nothing, accepted even when the field is refused."""


FIELDS: tuple[Field, ...] = (
    Field("model", ALL, True, True, "must be the served name (404 otherwise)"),
    Field("prompt", COMPLETIONS, True, True, "a string, token ids, or a list of either: one choice per prompt"),
    Field("messages", CHAT, True, True, "rendered with the model's chat template; text content parts"),
    Field("max_tokens", BOTH, True, True, "default 16 (completions), the context's room (chat)"),
    Field("max_completion_tokens", BOTH, True, True, "as max_tokens; wins when both are given (as vLLM)"),
    Field("temperature", ALL, True, True, f"0 is greedy; else at least {MIN_TEMPERATURE:g} (below, float32 cannot tell tokens apart)"),
    Field("top_p", ALL, True, True, f"in [{MIN_TOP_P:g}, 1] (float32's smallest normal number: below, no token is kept)"),
    Field("top_k", BOTH, False, True, "-1 or 0: no cut"),
    Field("min_p", BOTH, False, True, "in [0, 1]"),
    Field("presence_penalty", BOTH, True, True, f"over generated tokens, in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}]"),
    Field("frequency_penalty", BOTH, True, True, f"over generated tokens, in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}]"),
    Field("repetition_penalty", BOTH, False, True, f"transformers' rule, over prompt and output, in (0, {MAX_REPETITION_PENALTY:g}]"),
    Field("logit_bias", BOTH, True, True, f"token ids as strings, values in [{LOGIT_BIAS_RANGE[0]:g}, {LOGIT_BIAS_RANGE[1]:g}]"),
    Field("seed", BOTH, True, True, "choice i of a seeded request draws with seed + i"),
    Field("n", BOTH, True, True, "1 to 16 choices per prompt"),
    Field("stop", BOTH, True, True, "up to 4 strings; the text ends before one"),
    Field("stop_token_ids", BOTH, False, True, "token ids that end the answer (finish_reason stop)"),
    Field("ignore_eos", BOTH, False, True, "the model's end-of-sequence ids do not end the answer"),
    Field("min_tokens", BOTH, False, True, "no stop of any kind before this many tokens"),
    Field("include_stop_str_in_output", BOTH, False, True, "the stop string stays at the end of the text"),
    Field("skip_special_tokens", BOTH, False, True, "default true: special tokens leave no text"),
    Field("stream", ALL, True, True, "server-sent events, one chunk per piece of text"),
    Field("stream_options", BOTH, True, True, "include_usage: a last chunk with usage"),
    Field("logprobs", BOTH, True, True, "completions: 0 to 20 alternatives; chat: true for top_logprobs"),
    Field("top_logprobs", CHAT, True, True, "0 to 20, with logprobs: true"),
    Field("return_token_ids", BOTH, False, True, "prompt_token_ids and token_ids in each choice"),
    Field("service_tier", ALL, True, False, "picks a pool under --pool (priority: latency)"),
    Field("user", ALL, True, True, "accepted, no effect on the answer (a label)"),
    Field("metadata", CHAT_RESPONSES, True, False, "accepted, no effect on the answer (labels; nothing is stored)"),
    Field("request_id", BOTH, False, True, "accepted, no effect on the answer (a label)"),
    Field("store", CHAT_RESPONSES, True, False, "false only", "nothing is stored on this server", (None, False)),
    Field("best_of", COMPLETIONS, True, True, "at least n: the n of highest cumulative log-probability among best_of "
          "candidates (not streamed)"),
    Field("echo", BOTH, True, True, "completions: the prompt's text, and with logprobs its tokens' (the first null), "
          "before the completion; chat: false only"),
    Field("prompt_logprobs", BOTH, False, True, "completions: 0 to 20 alternatives, each prompt token's log-probability "
          "and rank (the first null); chat: refused"),
    Field("suffix", COMPLETIONS, True, False, "refused", "suffix (fill-in-the-middle) is not supported", (None, "")),
    Field("response_format", BOTH, True, True, "text; json_object; json_schema (its schema required, strict "
          "accepted, always enforced): the answer constrained by the grammar (docs/serve.md: Structured output)"),
    Field("tools", CHAT, True, True, "functions given to the chat template; with tool_choice required or named "
          "a call constrained by their parameters schemas, answered as message.tool_calls"),
    Field("tool_choice", CHAT, True, True, 'none, auto (the default with tools: calls parsed from the model\'s '
          "text in the server's format, Hermes <tool_call> or Llama 3 JSON, as the template shows or "
          '--tool-call-parser names; refused without one), required, or {"type": "function", "function": {"name"}}'),
    Field("parallel_tool_calls", CHAT, True, True, "with tool_choice required: false allows one call only"),
    Field("functions", CHAT, True, False, "refused", "functions (deprecated tools) are not there yet", (None, [])),
    Field("function_call", CHAT, True, False, "refused", "functions (deprecated tools) are not there yet", (None, "none")),
    Field("guided_json", BOTH, False, True, "a JSON schema (an object or its JSON text) the answer matches"),
    Field("guided_regex", BOTH, False, True, "a regular expression the whole answer matches"),
    Field("guided_choice", BOTH, False, True, "the answer is one of these strings"),
    Field("guided_grammar", BOTH, False, True, "an EBNF grammar (xgrammar's dialect, rule root) the answer matches"),
    Field("structured_outputs", BOTH, False, True, "one of json, regex, choice, grammar, json_object (as the "
          "guided_* fields; disable_any_whitespace: true is what is done anyway); its other keys refused"),
    Field("chat_template_kwargs", CHAT, False, True, "the chat template's variables (e.g. enable_thinking); not "
          "messages, tools or add_generation_prompt"),
    Field("chat_template", CHAT, False, True, "refused", "a request's own chat template is not accepted"),
    Field("add_generation_prompt", CHAT, False, True, "true only", "the template always adds the assistant's turn",
          (None, True)),
    Field("continue_final_message", CHAT, False, True, "false only", "continue_final_message is not there yet",
          (None, False)),
    Field("add_special_tokens", BOTH, False, True, "a text prompt gets the tokenizer's added tokens (a BOS): "
          "default true (completions), false (chat: the template writes them), as vLLM"),
    Field("spaces_between_special_tokens", BOTH, False, True, "true only",
          "phalanx's tokenizers decode special tokens as the tokenizer joins them", (None, True)),
    Field("truncate_prompt_tokens", BOTH, False, True, "refused", "prompts are never truncated here"),
    Field("allowed_token_ids", BOTH, False, True, "refused", "allowed_token_ids is not there yet"),
    Field("bad_words", BOTH, False, True, "refused", "bad_words is not there yet", (None, [])),
    Field("length_penalty", BOTH, False, True, "1 only", "length_penalty applies to beam search, which is not there",
          (None, 1, 1.0)),
    Field("use_beam_search", BOTH, False, True, "false only", "beam search is not there", (None, False)),
    Field("priority", BOTH, False, True, "0 only", "request priorities are not there yet", (None, 0)),
    Field("logits_processors", BOTH, False, True, "refused", "custom logits processors are not accepted"),
    Field("return_tokens_as_token_ids", BOTH, False, True, "refused", "return_tokens_as_token_ids is not there yet",
          (None, False)),
    Field("audio", CHAT, True, False, "refused", "this server serves text", (None,)),
    Field("modalities", CHAT, True, False, "text only", "this server serves text", (None, ["text"])),
    Field("prediction", CHAT, True, False, "refused", "predicted outputs are not there yet"),
    Field("reasoning_effort", CHAT, True, False, "refused", "reasoning_effort is not there yet"),
    Field("web_search_options", CHAT, True, False, "refused", "this server has no web search"),
    # /v1/responses (OpenAI's Responses API), answered as a chat completion of the same messages.
    Field("input", RESPONSES, True, True, "a string, or message items (role, text content): the chat's messages"),
    Field("instructions", RESPONSES, True, True, "a system message before the input"),
    Field("max_output_tokens", RESPONSES, True, True, "as chat's max_tokens (default: as many as the context holds)"),
    Field("top_logprobs", RESPONSES, True, True, "0 to 20: each output token's log-probability and alternatives"),
    Field("stream_options", RESPONSES, True, False, "accepted, no effect (the events are always the same)"),
    Field("previous_response_id", RESPONSES, True, True, "refused", "no response is stored on this server"),
    Field("conversation", RESPONSES, True, False, "refused", "no conversation is stored on this server"),
    Field("background", RESPONSES, True, True, "false only", "background responses need stored state", (None, False)),
    Field("include", RESPONSES, True, True, "empty only", "include is not there yet", (None, [])),
    Field("reasoning", RESPONSES, True, True, "refused", "reasoning settings are not there yet"),
    Field("text", RESPONSES, True, True, "text format only", "structured output is not there yet",
          (None, {"format": {"type": "text"}})),
    Field("tools", RESPONSES, True, True, "refused", "tools are not there yet", (None, [])),
    Field("tool_choice", RESPONSES, True, True, "none only", "tools are not there yet", (None, "none")),
    Field("parallel_tool_calls", RESPONSES, True, True, "accepted without tools (no effect)"),
    Field("max_tool_calls", RESPONSES, True, False, "refused", "tools are not there yet"),
    Field("truncation", RESPONSES, True, True, "disabled only", "inputs are never truncated here", (None, "disabled")),
    Field("prompt", RESPONSES, True, False, "refused", "stored prompt templates are not there"),
    Field("prompt_cache_key", RESPONSES, True, False, "accepted, no effect (the prefix cache needs no key)"),
    Field("safety_identifier", RESPONSES, True, False, "accepted, no effect on the answer (a label)"),
)

BY_ENDPOINT = {endpoint: {f.name: f for f in FIELDS if endpoint in f.where.split(", ")}
               for endpoint in (COMPLETIONS, CHAT, RESPONSES)}
PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions", RESPONSES: "/v1/responses"}


def refusal(body: dict, endpoint: str) -> tuple[str, str] | None:
    """(field, message) for the first field of `body` that `endpoint` refuses, or None."""
    for name, value in body.items():
        field = BY_ENDPOINT[endpoint].get(name)
        if field is None:
            return name, (f"unknown field {name!r} for {PATHS[endpoint]} (docs/serve.md lists every field and what "
                          "it does)")
        if field.refused and not any(value == neutral and type(value) is type(neutral) or value is neutral
                                     for neutral in field.neutral):
            return name, f"{name}: {field.refused}"
    return None


def markdown_table() -> str:
    """docs/serve.md's table of request fields."""
    yes = lambda flag: "yes" if flag else "-"  # noqa: E731
    lines = ["| field | endpoint | OpenAI | vLLM | phalanx |", "|---|---|---|---|---|"]
    for f in FIELDS:
        lines.append(f"| `{f.name}` | {f.where} | {yes(f.openai)} | {yes(f.vllm)} | "
                     f"{'refused: ' + f.refused if f.refused and f.phalanx == 'refused' else f.phalanx}"
                     f"{'' if not f.refused or f.phalanx == 'refused' else ' (else refused: ' + f.refused + ')'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
