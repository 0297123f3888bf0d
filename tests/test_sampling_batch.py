"""The batch sampler (inference/sampling.py) against a plain per-row reference of each field's
semantics (vLLM's, and transformers' rule for the repetition penalty): the processed logits of
a batch equal each row's own, computed alone and in Python (1e-6: the same float32 operations in
another order), greedy rows take the processed argmax, a banned token is never drawn, and a
seeded row draws the same token whatever shares its batch."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.errors import UserError
from phalanx.inference.sampling import Row, Sampling, pick_token, processed, sample, token_logprobs

VOCAB = 12


def _reference(logits: list[float], row: Row) -> list[float]:
    out = list(logits)
    for token in row.banned:
        out[token] = -math.inf
    for token, value in row.sampling.logit_bias:
        out[token] += value
    s = row.sampling
    for token in range(len(out)):
        count = list(row.output).count(token)
        if count or token in row.prompt:
            out[token] = out[token] / s.repetition_penalty if out[token] > 0 else out[token] * s.repetition_penalty
        out[token] -= s.frequency_penalty * count + s.presence_penalty * (count > 0)
    return out


ROWS = [
    Row(Sampling(greedy=True)),
    Row(Sampling(greedy=True, repetition_penalty=1.3), prompt=[1, 2, 2], output=[3]),
    Row(Sampling(greedy=True, presence_penalty=0.5, frequency_penalty=-0.25), prompt=[4], output=[5, 5, 6]),
    Row(Sampling(greedy=True, logit_bias=((7, 3.0), (0, -100.0))), output=[7]),
    Row(Sampling(greedy=True, repetition_penalty=0.7, frequency_penalty=1.0, logit_bias=((2, 1.5),)),
        prompt=[2, 9], output=[9, 9, 11], banned=frozenset({10, 11})),
]


def test_processed_logits_equal_each_row_alone():
    logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(0))
    got = processed(logits, ROWS)
    for index, row in enumerate(ROWS):
        want = torch.tensor(_reference(logits[index].tolist(), row))
        torch.testing.assert_close(got[index], want, rtol=1e-6, atol=1e-6)
    assert sample(logits, ROWS) == got.argmax(-1).tolist()


def test_a_banned_token_is_never_drawn_and_min_p_cuts():
    """Token 0 holds nearly all the mass but is banned: every draw is another. With min_p 0.5
    of probabilities 0.5, 0.3, 0.2 (after the ban), only the first two stay."""
    logits = torch.log(torch.tensor([[0.97, 0.015, 0.009, 0.006]]))
    row = Row(Sampling(temperature=1.0, top_k=0, min_p=0.5), torch.Generator().manual_seed(1), banned=frozenset({0}))
    draws = [sample(logits, [row])[0] for _ in range(300)]
    assert 0 not in draws and 3 not in draws and {1, 2} == set(draws)


def test_a_seeded_row_draws_the_same_whatever_its_batch():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    alone = Sampling(temperature=0.9, top_k=5, top_p=0.9, seed=11)
    first = sample(logits[:1], [Row(alone, alone.generator())])
    others = [Row(Sampling(temperature=1.0, top_k=0, seed=3), torch.Generator().manual_seed(3)),
              Row(Sampling(greedy=True))]
    batched = sample(logits, [Row(alone, alone.generator()), *others])
    assert batched[0] == first[0]
    assert pick_token(logits[0], alone, alone.generator()) == first[0]


def test_logprobs_of_the_model_distribution():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    chosen, tops = token_logprobs(logits, [3, 5], [2, 0])
    scores = torch.log_softmax(logits, -1)
    assert chosen == pytest.approx([float(scores[0, 3]), float(scores[1, 5])])
    assert [t for t, _ in tops[0]] == scores[0].topk(2).indices.tolist() and tops[1] == []


@pytest.mark.parametrize("fields, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(logit_bias=((1, 101.0),)), "logit_bias of token 1"),
    (dict(min_p=1.5), "--min-p must be in"),
    (dict(top_p=1e-46), "--top-p must be at least"),
])
def test_bad_settings_are_refused(fields, message):
    with pytest.raises(UserError, match=message):
        Sampling(temperature=1.0, **fields).validate()
