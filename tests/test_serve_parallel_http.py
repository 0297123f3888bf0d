"""`phalanx serve --nproc 2 --plan tp=2` through HTTP with the `openai` client: rank 0 serves
and schedules, both ranks run every forward on their halves of the heads and the vocabulary.
32 concurrent greedy completions each equal `transformers`' greedy generation (near-tie rule
of tests/serve_server.py: tensor parallelism sums the row-parallel matmuls in another order,
~1e-6); then SIGTERM ends both workers and the launcher exits 0."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.hf_models import VOCAB, write_checkpoint
from tests.serve_server import ServeProcess, assert_greedy_equal, transformers_greedy

pytest.importorskip("openai")
pytest.importorskip("transformers")


def test_tp2_equals_transformers_and_stops_on_sigterm(tmp_path):
    folder = write_checkpoint(tmp_path / "llama", "llama")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
               for n in torch.randint(4, 25, (32,), generator=generator)]
    new = 10
    server = ServeProcess(folder, "--nproc", "2", "--plan", "tp=2", "--block-size", "8", "--shutdown-grace", "1")
    try:
        client = server.client()
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda p: client.completions.create(
                model=server.name, prompt=p, max_tokens=new, temperature=0, extra_body={"return_token_ids": True}), prompts))
        server.signal(signal.SIGTERM)
        assert server.process.wait(120) == 0
    finally:
        server.stop()
    for answer, (reference, logits) in zip(answers, transformers_greedy(folder, prompts, new)):
        assert_greedy_equal(answer.choices[0].token_ids, reference, logits)
