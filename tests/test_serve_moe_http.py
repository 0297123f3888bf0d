"""`phalanx serve` of mixture-of-experts models (qwen3_moe with a dense layer among the MoE
ones, mixtral) through HTTP with the `openai` client: 32 concurrent greedy completions, each
equal to `transformers`' greedy generation under the near-tie rule of tests/serve_server.py,
and the per-rank expert loads in /metrics; Ctrl-C (SIGINT) then stops the server with 130."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.hf_models import VOCAB, write_checkpoint
from tests.serve_server import ServeProcess, assert_greedy_equal, transformers_greedy

pytest.importorskip("openai")
pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_concurrent_greedy_equals_transformers(tmp_path, family):
    folder = write_checkpoint(tmp_path / family, family)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
               for n in torch.randint(4, 25, (32,), generator=generator)]
    new = 10
    server = ServeProcess(folder, "--block-size", "8", "--max-num-batched-tokens", "96")
    try:
        client = server.client()
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda p: client.completions.create(
                model=server.name, prompt=p, max_tokens=new, temperature=0, extra_body={"return_token_ids": True}), prompts))
        samples = server.metrics()
        server.signal(signal.SIGINT)  # Ctrl-C: the same graceful stop as SIGTERM, exit 130
        assert server.process.wait(60) == 130
    finally:
        server.stop()
    for answer, (reference, logits) in zip(answers, transformers_greedy(folder, prompts, new)):
        assert_greedy_equal(answer.choices[0].token_ids, reference, logits)
    # One process is one expert rank: every routed row is its own, and nothing is imbalanced.
    layers = 2 if family == "qwen3_moe" else 3  # qwen3_moe's layer 1 is dense (mlp_only_layers)
    k = 2
    # Every token fed went through each MoE layer's k experts: the prompts less what the prefix
    # cache held, and each generated token but the last (no preemption: the pool is large).
    assert samples["phalanx_preemptions_total"] == 0
    fed = (samples["phalanx_prompt_tokens_total"] - samples["phalanx_prefix_cache_hits_total"]
           + samples["phalanx_generation_tokens_total"] - 32)
    assert samples['phalanx_expert_rows_total{rank="0"}'] == layers * k * fed
    assert samples["phalanx_expert_imbalance"] == 0
