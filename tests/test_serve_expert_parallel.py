"""`phalanx serve` with experts spread over ranks, through HTTP with the `openai` client, against
`transformers`' greedy generation (near-tie rule of tests/serve_server.py: the ranks' batches
differ from one process's, so fp32 sums part by ~1e-6; anywhere else the ids must be equal):

- `--plan dp=2,ep=2` (attention data parallelism: each rank runs its own sequences, tokens
  travel to their experts by all-to-all, a rank with nothing to run steps with filler forwards;
  SIGTERM then stops both ranks, exit 0)
  with live expert re-placement (`--expert-slots 8 --rebalance-every 10`) on a router skewed
  towards experts 0-2: outputs equal before any move, during one (32 concurrent streams, none
  fails) and after; the imbalance of the routed rows per rank falls.
- `--plan tp=2,ep=2,ep_over_tp=true`: 32 concurrent completions equal.

Both count every routed row once in /metrics (filler forwards' rows are not traffic).
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from phalanx.serve.dp_assign import DPSchedulers
from phalanx.scheduling.scheduler import Scheduler, Sequence
from phalanx.testing.cli_errors import assert_cli_error
from tests.hf_models import VOCAB, write_checkpoint
from tests.serve_server import ServeProcess, assert_greedy_equal, transformers_greedy

pytest.importorskip("openai")
pytest.importorskip("transformers")

MOE_LAYERS, TOP_K = 2, 2  # the tiny qwen3_moe: layers 0 and 2 (layer 1 is dense), 2 experts per token
EVERY = 10


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """The tiny qwen3_moe with a skewed router: channel 0 of every embedding raised by 2 and the
    router rows of experts 0-2 raised by 3 there, so those experts take nearly every top-2 pick
    (most logits still stay far from ties)."""
    import transformers

    folder = write_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 2
        for layer in (0, 2):
            model.model.layers[layer].mlp.gate.weight[:3, 0] += 3
    model.save_pretrained(folder)
    return folder


def prompts(seed: int, count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
            for n in torch.randint(4, 25, (count,), generator=generator)]


def complete(server: ServeProcess, batch: list[list[int]], new: int) -> list[list[int]]:
    client = server.client()
    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(lambda p: client.completions.create(
            model=server.name, prompt=p, max_tokens=new, temperature=0,
            extra_body={"return_token_ids": True}).choices[0].token_ids, batch))


def stream(server: ServeProcess, batch: list[list[int]], new: int) -> list[tuple[list[int], str]]:
    """Each prompt streamed: its token ids and its finish reason."""
    client = server.client()

    def one(prompt):
        ids, reason = [], None
        for chunk in client.completions.create(model=server.name, prompt=prompt, max_tokens=new, temperature=0,
                                               stream=True, extra_body={"return_token_ids": True}):
            if chunk.choices:
                ids += chunk.choices[0].token_ids or []
                reason = chunk.choices[0].finish_reason or reason
        return ids, reason

    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(one, batch))


ALONE, BEFORE, DURING, AFTER, OVER_TP = prompts(2, 1), prompts(3, 6), prompts(4, 32), prompts(5, 24), prompts(6, 8)
NEW = 4
"""Every prompt the tests send, and the most tokens any asks for."""


@pytest.fixture(scope="module")
def greedy(skewed):
    """{prompt: (transformers' greedy NEW tokens, their logits)} for every prompt, in one call
    (loading the reference model is most of its cost) and on one thread (two OpenMP threads on
    a shared machine made it several times slower). Greedy is prefix-consistent: a request for
    fewer tokens compares with the first ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batch = ALONE + BEFORE + DURING + AFTER[:8] + OVER_TP
        return {tuple(p): result for p, result in zip(batch, transformers_greedy(skewed, batch, NEW))}
    finally:
        torch.set_num_threads(threads)


def assert_all_equal(greedy: dict, batch: list[list[int]], served: list[list[int]], new: int) -> None:
    """Each served continuation (asked for `new` tokens) equals the reference's first `new`."""
    assert len(served) == len(batch)
    for prompt, ids in zip(batch, served):
        reference, logits = greedy[tuple(prompt)]
        assert_greedy_equal(ids, reference[:new], logits)


def rank_rows(samples: dict) -> list[float]:
    return [samples[f'phalanx_expert_rows_total{{rank="{rank}"}}'] for rank in range(2)]


def imbalance(rows: list[float]) -> float:
    mean = sum(rows) / len(rows)
    return (max(rows) - mean) / mean


def assert_rows_counted_once(samples: dict, requests: int) -> None:
    """Every token fed went through each MoE layer's k experts once: the prompts less what the
    prefix caches held, and each generated token but the last (no preemption here)."""
    assert samples["phalanx_preemptions_total"] == 0
    fed = (samples["phalanx_prompt_tokens_total"] - samples["phalanx_prefix_cache_hits_total"]
           + samples["phalanx_generation_tokens_total"] - requests)
    assert sum(rank_rows(samples)) == MOE_LAYERS * TOP_K * fed


def test_dp2_ep2_live_rebalance_keeps_outputs_and_evens_the_load(skewed, greedy):
    """Engine steps are what --rebalance-every counts. Before: one request alone (2 steps), then
    6 concurrent one-token requests (each done in its prompt's step): at most 8 steps, fewer
    than EVERY, so no move yet. During: 32 streams
    whose prompts (~450 tokens) take the two ranks ~10 steps at 24 tokens each per step, then
    3 decodes: they run across step EVERY + 1, where the first move is made. After: 24 requests
    (8 compared), whose rows per rank are measured against the before phase's."""
    alone, before, during, after = ALONE, BEFORE, DURING, AFTER
    server = ServeProcess(skewed, "--nproc", "2", "--plan", "dp=2,ep=2", "--expert-slots", "8",
                          "--rebalance-every", str(EVERY), "--block-size", "8", "--max-num-batched-tokens", "24",
                          "--shutdown-grace", "1")
    try:
        # One request alone (2 steps) runs on rank 0, while rank 1 steps with filler forwards.
        served_alone = complete(server, alone, 2)
        at_alone = server.metrics()
        served_before = complete(server, before, 1)
        at_before = server.metrics()
        assert at_before["phalanx_expert_rebalances_total"] == 0
        streamed = stream(server, during, NEW)
        at_during = server.metrics()
        assert at_during["phalanx_expert_rebalances_total"] >= 1
        served_after = complete(server, after, NEW)[:8]
        at_after = server.metrics()
        server.signal(signal.SIGTERM)  # rank 0 drains and stops the other rank; the launcher exits 0
        assert server.process.wait(120) == 0
    finally:
        server.stop()
    assert [reason for _, reason in streamed] == ["length"] * 32  # none failed
    assert_all_equal(greedy, alone, served_alone, 2)
    assert_all_equal(greedy, before, served_before, 1)
    assert_all_equal(greedy, during, [ids for ids, _ in streamed], NEW)
    assert_all_equal(greedy, after[:8], served_after, NEW)
    assert_rows_counted_once(at_after, 1 + 6 + 32 + 24)
    # The moves evened the load: rows per rank after them, against before any move.
    skew_before = imbalance([b - a for a, b in zip(rank_rows(at_alone), rank_rows(at_before))])
    skew_after = imbalance([a - b for a, b in zip(rank_rows(at_after), rank_rows(at_during))])
    print(f"imbalance of rows per rank: {skew_before:.3f} before any move, {skew_after:.3f} after")
    assert skew_after < skew_before, (skew_before, skew_after)
    assert at_after["phalanx_expert_imbalance_after_rebalance"] < at_after["phalanx_expert_imbalance_before_rebalance"]


def test_tp2_ep2_over_tp_equals_transformers(skewed, greedy):
    batch = OVER_TP
    server = ServeProcess(skewed, "--nproc", "2", "--plan", "tp=2,ep=2,ep_over_tp=true", "--block-size", "8")
    try:
        served = complete(server, batch, NEW)
        samples = server.metrics()
    finally:
        server.stop()
    assert_all_equal(greedy, batch, served, NEW)
    assert_rows_counted_once(samples, 8)


def test_requests_go_to_the_least_busy_dp_rank():
    """A new request joins the dp rank with the fewest sequences, the lowest among equals; an
    abort finds the rank that holds the sequence."""
    parts = DPSchedulers([Scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                    max_waiting=8) for _ in range(2)])
    seqs = [Sequence.of(str(i), [1, 2, 3], 2) for i in range(3)]
    for seq in seqs:
        parts.add(seq)
    assert [len(part.waiting) for part in parts.parts] == [2, 1]
    assert parts.parts[1].waiting[0] is seqs[1]
    assert parts.abort(seqs[1]) and [len(part.waiting) for part in parts.parts] == [2, 0]
    parts.add(Sequence.of("3", [1], 2))
    assert [len(part.waiting) for part in parts.parts] == [2, 1] and len(parts.waiting) == 3


@pytest.mark.parametrize("flags, message", [
    (["--plan", "dp=2,ep=2", "--expert-slots", "5"], "fewer slots than the 6 experts"),
    (["--plan", "dp=2,ep=2", "--expert-slots", "7"], "not a multiple of ep=2"),
    (["--plan", "tp=2,ep=2,ep_over_tp=true", "--rebalance-every", "4"], "ep_over_tp"),
    (["--plan", "dp=2,ep=4"], "ep=4"),
    (["--plan", "dp=2"], "has dp=2, ep=1"),
    (["--plan", "dp=2,ep=2", "--rebalance-every", "-1"], "--rebalance-every must be >= 0"),
    (["--plan", "dp=2,ep=2", "--expert-placement", "/nonexistent/run"], "/nonexistent/run"),
])
def test_bad_expert_flags(skewed, capsys, flags, message):
    assert_cli_error(["serve", "--model", str(skewed), "--nproc", "2", *flags], capsys, message)


def test_expert_parallel_needs_experts(tmp_path, capsys):
    dense = write_checkpoint(tmp_path / "llama", "llama")
    capsys.readouterr()  # transformers' progress bars
    assert_cli_error(["serve", "--model", str(dense), "--nproc", "2", "--plan", "dp=2,ep=2"], capsys,
                     "needs a mixture-of-experts model")


def test_expert_placement_starts_from_a_training_runs_loads(skewed, tmp_path):
    """`--expert-placement RUN_DIR`: the first placement is the balancer's for the per-expert
    loads the run's metrics.jsonl recorded (summed over its steps), so the expert that was hot
    in training starts with a replica on each rank; a run of another model is a one-line error."""
    import json
    from types import SimpleNamespace

    from phalanx.balance.solve import rebalance
    from phalanx.errors import UserError
    from phalanx.model.hf_config import read_model_config
    from phalanx.plan import plan_from_string
    from phalanx.serve.expert_placement import first_placement

    hot = [[90, 2, 2, 2, 2, 2], [2, 2, 2, 2, 2, 90]]  # per MoE layer (0 and 2), tokens per expert
    records = [{"step": step, "moe": {"0": {"expert_tokens": hot[0]}, "2": {"expert_tokens": hot[1]}}} for step in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    cfg, plan = read_model_config(skewed), plan_from_string("dp=2,ep=2", 2)
    job = SimpleNamespace(expert_slots=8, rebalance_every=0, expert_placement=str(tmp_path))  # a ServeJob's fields
    placed = first_placement(job, cfg, plan)
    assert (placed == rebalance([[2 * x for x in row] for row in hot], 8, 1, 1, 2, policy="global").phy2log).all()
    for row, expert in zip(placed, (0, 5)):
        assert set(row[:4]) & {expert} and set(row[4:]) & {expert}  # a replica on each rank
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"moe": {"0": {"expert_tokens": [1] * 4}}}) + "\n")
    with pytest.raises(UserError, match="1 MoE layers x 4 experts; this model has 2 x 6"):
        first_placement(job, cfg, plan)
