"""Token choice: greedy is the first maximum, top-k and top-p cut where they should, and the
draws follow the renormalized probabilities (checked by frequency over many draws)."""

from __future__ import annotations

import pytest
import torch

from phalanx.errors import UserError
from phalanx.inference.sampling import Sampling, pick_token
from phalanx.train.sample import generate


def test_greedy_takes_the_first_maximum():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert pick_token(logits, Sampling(greedy=True), torch.Generator()) == 1 == int(logits.argmax())


def _frequencies(sampling: Sampling, logits: torch.Tensor, draws: int = 4000) -> torch.Tensor:
    generator = sampling.generator()
    counts = torch.zeros(logits.numel())
    for _ in range(draws):
        counts[pick_token(logits, sampling, generator)] += 1
    return counts / draws


def test_top_k_and_top_p_draw_from_the_renormalized_head():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top-p 0.7 keeps the first two (mass before the third
    is 0.8), renormalized to 0.625 / 0.375; top-k 3 keeps three, renormalized by 0.95. The
    binomial standard error over 4000 draws is <= 0.008, so 0.03 is about 4 of them."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    top_p = _frequencies(Sampling(temperature=1.0, top_k=0, top_p=0.7), logits)
    torch.testing.assert_close(top_p, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.03, rtol=0)
    top_k = _frequencies(Sampling(temperature=1.0, top_k=3), logits)
    torch.testing.assert_close(top_k, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.03, rtol=0)
    # A temperature of 0.5 squares the probabilities before renormalizing.
    sharp = _frequencies(Sampling(temperature=0.5, top_k=0), logits)
    torch.testing.assert_close(sharp, probs**2 / (probs**2).sum(), atol=0.03, rtol=0)


@pytest.mark.parametrize("fields, message", [
    (dict(temperature=0.0), "--temperature must be > 0"),
    (dict(temperature=float("nan")), "--temperature must be > 0"),
    (dict(top_k=-1), "--top-k must be >= 0"),
    (dict(top_p=0.0), "--top-p must be in (0, 1]"),
    (dict(top_p=1.5), "--top-p must be in (0, 1]"),
])
def test_bad_sampling_settings(fields, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("]", r"\]")):
        Sampling(**fields).validate()


def test_end_of_run_sample_is_cached_generation_within_the_context():
    """The training run's sample is `generate_ids` with the run's sampling (temperature 0.8,
    top-k 40, its seed) and never overflows the model's positions: 1000 bytes asked of a
    context of 32 positions gives 32 - len(prompt) new bytes."""
    from phalanx.data.tokenizer import decode
    from phalanx.inference.decoding import generate_ids
    from phalanx.model.by_name import model_config
    from phalanx.model.init import build_model, init_weights

    cfg = model_config("tiny").replace(max_seq_len=32)
    model = init_weights(build_model(cfg), cfg, seed=0, device="cpu")
    text = generate(model, "def ", tokens=1000, max_seq_len=32, device="cpu", seed=4)
    new = generate_ids(model, list(b"def "), max_new_tokens=28, max_len=32, sampling=Sampling(seed=4)).new_ids
    assert len(new) == 28
    assert text == decode(list(b"def ") + new)
