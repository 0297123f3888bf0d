"""One request cannot fail the others: a sequence whose sampling raises (a temperature far below
the API's bound, set here past the API's check, turns its probabilities to nan) ends alone
with an error event, its blocks freed, while the greedy sequences beside it in every step
finish with exactly the tokens they get when they run without it (the same batch shapes but
for one row: tokens compared, equal as in tests/test_serve_engine.py's batch invariance)."""

from __future__ import annotations

import pytest
import torch

import phalanx.hf as hf
from phalanx.serve.engine import Engine
from phalanx.serve.sampling_params import request_sampling
from phalanx.scheduling.scheduler import Scheduler, Sequence
from tests.hf_models import VOCAB, write_checkpoint

pytest.importorskip("transformers")


def _run(model, bad: bool):
    scheduler = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_waiting=16)
    engine = Engine(model, scheduler)
    generator = torch.Generator().manual_seed(5)
    good = [Sequence.of(f"good{i}", torch.randint(0, VOCAB, (6 + i,), generator=generator).tolist(), 12,
                     params=request_sampling(0, 1, None, 0)) for i in range(3)]
    for seq in good:
        scheduler.add(seq)
    if bad:
        scheduler.add(Sequence.of("bad", [1, 2, 3, 4, 5], 12, params=request_sampling(1e-300, 1, None, 0)))
    events = []
    while scheduler.has_work():
        events += engine.step()
    return {seq.seq_id: seq.output for seq in good}, events, scheduler


def test_a_failing_sampler_fails_its_request_alone(tmp_path):
    torch.set_num_threads(1)
    model = hf.load(write_checkpoint(tmp_path / "llama", "llama"))
    alone, _, _ = _run(model, bad=False)
    beside, events, scheduler = _run(model, bad=True)
    failed = [e for e in events if e.error]
    assert len(failed) == 1 and failed[0].seq.seq_id == "bad" and failed[0].token is None
    assert "sampling failed for this request" in failed[0].error
    assert failed[0].seq.finish_reason == "error"
    assert not [e for e in events if e.seq.seq_id == "bad" and not e.error]  # no token after its failure
    assert beside == alone
    assert all(len(tokens) == 12 for tokens in beside.values())
    assert scheduler.blocks.num_used == 0  # every block back, the failed one's too
