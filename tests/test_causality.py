"""The single-device model is causal: the logits at a position depend only on that position
and the ones before it. Every parallel layout is compared with this model, so a leak here
(a missing mask, a norm or router that mixes positions) would pass every equivalence test."""

from __future__ import annotations

import pytest
import torch

from phalanx.model.by_name import model_config
from phalanx.model.init import build_model, init_weights


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_changing_a_future_token_never_changes_earlier_logits(name):
    """Within one forward the rows of each matrix product are computed independently, so the
    earlier positions' logits must agree to the last bit with at most float reassociation
    (1e-6 allowed); the changed position's own logits must move (else the test proves nothing).
    tiny-moe routes each token alone (no capacity limit), so it is causal as well."""
    cfg = model_config(name)
    model = init_weights(build_model(cfg), cfg, seed=0, device="cpu").eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(tokens)  # (batch, seq, vocab)
        for position in (0, 11, 23):
            changed = tokens.clone()
            changed[:, position] = (changed[:, position] + 1) % cfg.vocab_size
            after = model(changed)
            torch.testing.assert_close(after[:, :position], before[:, :position], atol=1e-6, rtol=1e-6)
            assert (after[:, position] - before[:, position]).abs().max() > 1e-3
