"""Speculative decoding by prompt lookup (`--speculative-config`): the guesses (plain data),
the rule that keeps them (the tokens are those of decoding one token a step), and the engine
with guesses against the engine without, greedy and seeded.

The engine comparisons use the near-tie rule of tests/serve_server.py: a step with guesses
feeds several positions of a sequence in one packed chunk, whose matmuls add in another order
than a one-row decode's (~1e-6), so a greedy pick may differ only where the top two logits are
that close.
"""

from __future__ import annotations

import pytest
import torch

import phalanx.hf as hf
from phalanx.cpu_ops.onednn_linear import use_onednn
from phalanx.errors import UserError
from phalanx.inference.sampling import Sampling
from phalanx.scheduling.scheduler import Chunk, Scheduler, Sequence
from phalanx.scheduling.speculation import SpeculativeConfig
from phalanx.serve.engine import Engine
from phalanx.serve.sampling_params import SamplingParams, request_sampling
from phalanx.serve.speculative import kept_and_next
from tests.hf_models import write_checkpoint
from tests.serve_server import assert_greedy_equal

LOOKUP = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


def test_guesses_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    assert LOOKUP.propose([1, 2, 3, 4, 1, 2], 8) == [3, 4, 1]
    assert LOOKUP.propose([1, 2, 9, 1, 2, 8, 1, 2], 8) == [8, 1, 2]  # the latest [1, 2] wins
    assert LOOKUP.propose([7, 5, 6, 5, 7, 5], 8) == [6, 5, 7]  # [7, 5] (n=2) before [5] (n=1): what follows 7, 5
    assert LOOKUP.propose([1, 2, 3, 4, 1, 2], 1) == [3]  # within what the sequence may still have
    assert LOOKUP.propose([5, 6, 7], 8) == [] and LOOKUP.propose([4], 8) == []
    assert SpeculativeConfig(2, prompt_lookup_max=4, prompt_lookup_min=2).propose([3, 9, 3], 8) == []  # n=1 not tried


@pytest.mark.parametrize("text,message", [
    ("{", "not JSON"), ("[4]", "JSON object"), ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"), ('{"num_speculative_tokens": 0}', ">= 1"),
    ('{"num_speculative_tokens": true}', ">= 1"), ('{"num_speculative_tokens": 2, "draft_model": "x"}', "draft_model"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "above"),
])
def test_bad_speculative_config_is_one_line(text, message):
    with pytest.raises(UserError, match=message):
        SpeculativeConfig.parse(text)


def test_scheduler_keeps_only_the_kept_guesses_computed():
    """A decoding sequence of 6 tokens guesses 3 (blocks for 9 positions); two are kept and
    the model's next token follows: 9 tokens, 8 of them computed (the last is fed next step)."""
    scheduler = Scheduler(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_waiting=4,
                          speculative=LOOKUP)
    seq = Sequence.of("a", [1, 2, 3, 4, 1], 10, may_speculate=True)
    scheduler.add(seq)
    step = scheduler.schedule()
    scheduler.finish_step(step, {id(seq): 2})  # the prompt, then the first token: ..., 1, 2
    step = scheduler.schedule()
    [chunk] = step.chunks
    assert (chunk.start, chunk.length, chunk.guesses, chunk.ids) == (5, 4, (3, 4, 1), [2, 3, 4, 1])
    assert len(seq.block_table) == 3  # 9 positions
    scheduler.finish_step(step, {id(seq): [3, 4, 9]})
    assert seq.tokens == [1, 2, 3, 4, 1, 2, 3, 4, 9] and seq.num_computed == 8
    assert (scheduler.guessed_tokens, scheduler.kept_guesses) == (3, 2)


def test_no_guesses_beyond_the_batch_size_set():
    """disable_by_batch_size 1: one sequence guesses, two running do not."""
    config = SpeculativeConfig.parse('{"num_speculative_tokens": 3, "disable_by_batch_size": 1}')
    scheduler = Scheduler(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, max_waiting=4,
                          speculative=config)
    first = Sequence.of("a", [1, 2, 3, 4, 1], 10, may_speculate=True)
    scheduler.add(first)
    scheduler.finish_step(scheduler.schedule(), {id(first): 2})
    alone = scheduler.schedule()
    assert alone.chunks[0].guesses == (3, 4, 1)
    scheduler.finish_step(alone, {id(first): [3]})
    second = Sequence.of("b", [1, 2, 3, 1, 2], 10, may_speculate=True)
    scheduler.add(second)
    scheduler.finish_step(scheduler.schedule(), {id(first): 4, id(second): 3})
    assert all(chunk.guesses == () for chunk in scheduler.schedule().chunks)


def test_an_end_among_the_kept_tokens_ends_the_sequence_there():
    scheduler = Scheduler(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_waiting=4,
                          speculative=LOOKUP)
    seq = Sequence.of("a", [1, 2, 3, 4, 1], 10, frozenset({4}), may_speculate=True)
    scheduler.add(seq)
    scheduler.finish_step(scheduler.schedule(), {id(seq): 2})
    finished = scheduler.finish_step(scheduler.schedule(), {id(seq): [3, 4, 1]})
    assert finished == [seq] and seq.output == [2, 3, 4] and seq.finish_reason == "stop"


def test_kept_tokens_are_distributed_as_plain_sampling():
    """The rejection test on a vocabulary of 4: with guesses (1, 2), the first token is drawn
    from row 0 (0.5, 0.3, 0.15, 0.05) whatever was guessed; the guess 1 is kept as often as row
    0 gives it (0.3); after it the next token follows row 1 (0.1, 0.2, 0.6, 0.1), and the
    second guess 2 is kept as often as row 1 gives it. 6000 draws: the binomial standard error
    is <= 0.0065 (0.012 for the ~1800 kept), so 0.03 and 0.04 are about 4.5 and 3.5 of them."""
    rows = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.6, 0.1], [0.25, 0.25, 0.25, 0.25]]).log()
    seq = Sequence.of("a", [0], 10)
    chunk = Chunk(seq, 0, 3, (1, 2))
    params = SamplingParams(Sampling(temperature=1.0, top_k=0))
    generator = torch.Generator().manual_seed(0)
    firsts, seconds, draws = torch.zeros(4), torch.zeros(4), 6000
    for _ in range(draws):
        first = int(torch.multinomial(rows[0].exp(), 1, generator=generator))  # the engine's batch draw
        new = kept_and_next(rows, chunk, first, [1, 2], params, generator)
        firsts[new[0]] += 1
        if len(new) > 1:
            seconds[new[1]] += 1
            assert new[0] == 1
        assert len(new) == 1 or new[0] == 1 and (len(new) == 2 or new[1] == 2)
    torch.testing.assert_close(firsts / draws, rows[0].exp(), atol=0.03, rtol=0)
    torch.testing.assert_close(seconds / seconds.sum(), rows[1].exp(), atol=0.04, rtol=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    loaded = hf.load(write_checkpoint(tmp_path_factory.mktemp("spec") / "hf", "llama"))
    use_onednn(loaded)  # as `phalanx serve` loads it on CPU
    return loaded


def _serve(model, prompts: dict[str, list[int]], params, speculative=None):
    """Every sequence's output and the logits of its first pick of each step, and the scheduler."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in prompts}
    scheduler = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_waiting=16,
                          speculative=speculative)
    engine = Engine(model, scheduler, on_logits=lambda seq, row: seen[seq.seq_id].append(row.clone()))
    seqs = [Sequence.of(name, prompt, 40, params=params, may_speculate=True) for name, prompt in prompts.items()]
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work():
        engine.step()
    return {seq.seq_id: seq.output for seq in seqs}, scheduler


def _prompts() -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(11)
    loops = {name: torch.randint(0, 96, (n,), generator=generator).tolist() * 4 for name, n in (("a", 3), ("b", 5))}
    return loops | {"c": torch.randint(0, 96, (17,), generator=generator).tolist()}


def test_greedy_with_guesses_equals_greedy_without(model):
    """Prompts that repeat themselves (guesses come from them) and one that does not, 40 tokens
    each, greedy: the same ids as the engine without guesses, and guesses were kept."""
    plain, _ = _serve(model, _prompts(), request_sampling(0, 1, None, 0))
    guessed, scheduler = _serve(model, _prompts(), request_sampling(0, 1, None, 0), LOOKUP)
    reference_logits = _serve_logits(model)
    for name in plain:
        assert_greedy_equal(guessed[name], plain[name], reference_logits[name])
    assert scheduler.kept_guesses > 0, "no guess was kept: the test would prove nothing"


def _serve_logits(model) -> dict[str, torch.Tensor]:
    rows: dict[str, list[torch.Tensor]] = {}
    scheduler = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_waiting=16)
    engine = Engine(model, scheduler, on_logits=lambda seq, row: rows.setdefault(seq.seq_id, []).append(row.clone()))
    for name, prompt in _prompts().items():
        scheduler.add(Sequence.of(name, prompt, 40, params=request_sampling(0, 1, None, 0)))
    while scheduler.has_work():
        engine.step()
    return {name: torch.stack(found) for name, found in rows.items()}


def test_a_seeded_draw_is_the_same_with_guesses(model):
    """Temperature 0.5, seed 3: every token is the request's own draw in order, so the output
    with guesses equals the output without."""
    params = request_sampling(0.5, 1, None, 3)
    plain, _ = _serve(model, _prompts(), params)
    guessed, scheduler = _serve(model, _prompts(), params, LOOKUP)
    assert guessed == plain
    assert scheduler.guessed_tokens > 0


def test_server_with_guesses_equals_transformers(tmp_path):
    """`phalanx serve --speculative-config` through the real `openai` client: greedy ids equal
    `transformers`' (near-tie rule), streamed pieces add up to the unstreamed text, and
    /metrics counts the guesses and their acceptance rate."""
    pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from tests.serve_server import ServeProcess, transformers_greedy

    folder = write_checkpoint(tmp_path / "llama", "llama", vocab_size=256)
    prompts = list(_prompts().values())
    server = ServeProcess(folder, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    try:
        client = server.client()

        def complete(prompt):
            return client.completions.create(model=server.name, prompt=prompt, max_tokens=30, temperature=0,
                                             extra_body={"return_token_ids": True}).choices[0]

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(complete, prompts))
        for answer, (reference, logits) in zip(answers, transformers_greedy(folder, prompts, 30)):
            assert_greedy_equal(answer.token_ids, reference, logits)
        streamed = client.completions.create(model=server.name, prompt=prompts[0], max_tokens=30, temperature=0,
                                             stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == answers[0].text
        samples = server.metrics()
        assert samples["phalanx_spec_decode_draft_tokens_total"] > 0
        rate = samples["phalanx_spec_decode_acceptance_rate"]
        assert rate == samples["phalanx_spec_decode_accepted_tokens_total"] / samples[
            "phalanx_spec_decode_draft_tokens_total"] and rate > 0
    finally:
        server.stop()
