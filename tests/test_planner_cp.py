"""The planner's context parallelism (issue 24): the layout's cp, what it divides and what it
adds, the rules it obeys, and cp priced against tp on the same physics.

Exact checks compare the cost model with the formula it states (1e-12 relative: the same
floating-point terms in another order); the law compares two layouts' predictions.
"""

from __future__ import annotations

import json

import pytest

from phalanx.model.config import PRESETS, ModelConfig
from phalanx import cli
from phalanx.planner import comm
from phalanx.planner.cost import evaluate
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.layout import Layout, Workload
from phalanx.planner.memory import layer_activation_bytes
from phalanx.planner.options import Options
from phalanx.planner.peak_memory import gathered_kv_bytes, kv_gather_bytes
from phalanx.planner.search import SearchSpace, search
from phalanx.testing.cli_errors import assert_cli_error

H100 = CLUSTERS["dgx-h100"]
GQA = ModelConfig(name="gqa", dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_dim=2816, vocab_size=32000,
                  max_seq_len=65536)
LONG = Workload(global_batch=8, seq_len=16384)


def test_layout_world_and_round_trip_through_fix(tmp_path, capsys):
    """world = dp x cp x tp x pp; a `--json` row carries cp, and its `fix` string plans it again."""
    lay = Layout(dp=2, cp=4, tp=2, pp=1, microbatches=4, mbs=1)
    assert lay.world_size == 16 and lay.replicas == 8 and "cp=4" in lay.to_string()
    argv = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "64",
            "--seq-len", "131072", "--top", "1", "--json"]
    assert cli.run([*argv, "--fix", "cp=8,tp=1,pp=1,recompute=full"]) == 0  # all blocks: a fix that round-trips
    row = json.loads(capsys.readouterr().out)["plans"][0]
    assert row["cp"] == 8 and row["dp"] == 8 and "cp=8" in row["plan"]
    assert cli.run([*argv, "--fix", row["fix"]]) == 0
    again = json.loads(capsys.readouterr().out)["plans"][0]
    assert again["fix"] == row["fix"] and again["step_time_s"] == row["step_time_s"]


def test_activations_divide_by_cp_except_the_gathered_keys_and_values():
    """Every stored tensor holds seq / cp positions, but attention saves the whole sequence's
    keys and values (4 seq b h_kv bytes at 16 bits)."""
    kw = dict(seq=16384, mbs=1, tp=1, sp=False, recompute="none", moe=False)
    whole = layer_activation_bytes(GQA, **kw)
    kv = 4 * 16384 * GQA.n_kv_heads * GQA.head_dim
    assert layer_activation_bytes(GQA, cp=4, **kw) == pytest.approx((whole - kv) / 4 + kv, rel=1e-12)
    assert layer_activation_bytes(GQA, cp=4, **{**kw, "recompute": "full"}) == pytest.approx(
        layer_activation_bytes(GQA, **{**kw, "recompute": "full"}) / 4, rel=1e-12)


def test_cp_traffic_is_one_gather_forward_and_one_reduce_scatter_backward_per_layer():
    """4 layers x 2 micro-batches x 2 passes of an all-gather of the whole sequence's keys and
    values (2 seq h_kv / tp bf16 elements), over a group tp ranks apart: inside the NVLink domain
    while tp x cp fits in it (8 GPUs), across it beyond."""
    for tp, cp in ((2, 4), (4, 4)):
        lay = Layout(dp=1, cp=cp, tp=tp, sp=True, microbatches=8, mbs=1)
        est = evaluate(GQA, H100, LONG, lay)
        nbytes = kv_gather_bytes(GQA, 1, LONG.seq_len, tp)
        assert nbytes == 2 * LONG.seq_len * GQA.n_kv_heads * GQA.head_dim / tp * 2
        per_layer = comm.all_gather(H100, nbytes, size=cp, stride=tp)
        assert est.breakdown["cp_comm"] == pytest.approx(8 * 2 * GQA.n_layers * per_layer, rel=1e-12)
        assert comm.per_domain(H100, size=cp, stride=tp) == (cp if tp * cp <= 8 else 8 // tp)
    # Context parallelism shares each sequence's compute: the ranks of cp=4 do a quarter of one's.
    one = evaluate(GQA, H100, LONG, Layout(dp=1, microbatches=8, mbs=1))
    four = evaluate(GQA, H100, LONG, Layout(dp=1, cp=4, microbatches=8, mbs=1))
    assert four.world_size == 4 and four.breakdown["compute"] < one.breakdown["compute"] / 3.5


def test_latent_attention_gathers_its_latent_and_searches_cp():
    """Latent attention's cp gathers the latent and the rotated shared key per token, whole on
    every tp rank (parallel/context_parallel.py), not the decompressed heads: DeepSeek-V3's
    512 + 64 values against 128 heads x (192 + 128); the search offers it cp like any model."""
    v3 = PRESETS["deepseek-v3"]
    assert kv_gather_bytes(v3, 1, 4096, 8) == 4096 * (512 + 64) * 2
    assert gathered_kv_bytes(v3, 1, 4096, 8) == 4096 * 128 * (192 + 128) / 8 * 2  # what attention reads, decompressed
    tiny = PRESETS["tiny-dsv3"]
    lay = Layout(dp=1, cp=2, microbatches=2, mbs=1)
    est = evaluate(tiny, H100, Workload(global_batch=2, seq_len=256), lay)
    per_layer = comm.all_gather(H100, kv_gather_bytes(tiny, 1, 256, 1), size=2, stride=1)
    assert est.breakdown["cp_comm"] == pytest.approx(2 * 2 * tiny.n_layers * per_layer, rel=1e-12)


def test_ring_overlap_hides_the_transfer_behind_attention():
    """Options.cp_overlap (a ring): at 16k tokens attention per layer outlasts the gather, so
    only the SM share of the hidden transfer is left."""
    lay = Layout(dp=1, cp=4, microbatches=8, mbs=1)
    gathered = evaluate(GQA, H100, LONG, lay).breakdown["cp_comm"]
    ring = evaluate(GQA, H100, LONG, lay, Options(cp_overlap=True)).breakdown["cp_comm"]
    assert ring == pytest.approx(gathered * H100.hidden_comm_cost, rel=1e-9) and ring < gathered


def test_zero_shards_and_experts_spread_over_dp_x_cp():
    """Parameters are replicated over cp: zero 3 over dp=2 x cp=2 shards like dp=4, and ep may
    take all four ranks."""
    moe = PRESETS["small-moe"]
    work = Workload(global_batch=2, seq_len=256)
    a = evaluate(moe, H100, work, Layout(dp=2, cp=2, ep=4, zero=3, microbatches=1, mbs=1))
    b = evaluate(moe, H100, work, Layout(dp=4, cp=1, ep=4, zero=3, microbatches=1, mbs=1))
    for key in ("parameters", "gradients", "optimizer_state"):
        assert a.memory_breakdown[key] == pytest.approx(b.memory_breakdown[key], rel=1e-12)
    found = search(moe, H100, work, world_size=4, fixed={"cp": 2, "ep": 4}, space=SearchSpace(min_cp_chunk=1))
    assert found.ranked and all((e.layout.dp, e.layout.cp, e.layout.ep) == (2, 2, 4) for e in found.ranked)


def test_sequence_length_must_divide_into_the_chunks(tmp_path, capsys):
    argv = ["plan", "--model", "tiny", "--gpus", "4", "--global-batch", "4"]
    assert_cli_error([*argv, "--seq-len", "36", "--fix", "cp=4"], capsys, "seq_len=36 must divide by 2 x cp = 8 (cp=4)")
    assert_cli_error([*argv, "--seq-len", "20", "--fix", "cp=2,tp=2,sp=true"], capsys,
                     "seq_len=20 must divide by 2 x cp x tp = 2 x 2 x 2 = 8 (cp=2 with sp=true)")
    assert_cli_error([*argv, "--seq-len", "64", "--fix", "cp=0"], capsys, "cp=0 must be at least 1")
    assert_cli_error([*argv, "--seq-len", "64", "--fix", "cp=1,cp_ring=true"], capsys, "cp_ring=true needs cp > 1")
    assert_cli_error(["plan", "--model", "tiny-dsv3", "--gpus", "2", "--global-batch", "2", "--seq-len", "64", "--fix",
                      "cp=2,cp_ring=true"], capsys, "cp_ring=true does not run latent attention (model 'tiny-dsv3')")


def test_long_sequences_cp_beats_tp_on_llama_8b():
    """Llama-3.1-8B's shape (32 heads, 8 KV heads) at 131,072 tokens, global batch 64, on 64
    H100s, both at dp=8 on the published implementations' physics (`Options()`): tp=8's
    collectives carry every token's hidden state (4 per layer, 2 s h bytes each), cp=8's only
    the keys and values (2 per layer of 2 s h_kv x 2 bytes: h_kv = h / 4), so cp spends a
    fraction of tp's time communicating and wins the step."""
    model, work = PRESETS["llama3-8b"], Workload(global_batch=64, seq_len=131072)
    assert (model.n_heads, model.n_kv_heads) == (32, 8)
    best = {}
    for name, fix in (("cp", {"dp": 8, "cp": 8, "tp": 1, "pp": 1}), ("tp", {"dp": 8, "cp": 1, "tp": 8, "pp": 1})):
        result = search(model, H100, work, world_size=64, fixed=fix, options=Options(),
                        space=SearchSpace(phalanx_trainer=False), keep=1)
        best[name] = result.ranked[0]
    cp, tp = best["cp"], best["tp"]
    assert cp.breakdown["cp_comm"] < tp.breakdown["tp_comm"] / 4
    assert cp.step_time_s < tp.step_time_s


def test_trainer_hides_its_gather_behind_each_chunks_diagonal_block():
    """The phalanx trainer's cp attention (issue 38) computes each chunk's causal diagonal block,
    which needs only the rank's own keys, while the gather travels, and those blocks' gradients
    while the reduce-scatter does: 1/(2 cp) of the attention forward and backward hides the
    transfer (its SM share left), per layer and micro-batch; the published implementations'
    gather stays exposed. Its attention is the causal half, as everyone's."""
    from phalanx.planner.stage_time import layer_costs, trainer_cp_hidden

    lay = Layout(dp=1, cp=4, microbatches=8, mbs=1)
    trainer = Options(phalanx_trainer=True)
    per_layer = comm.all_gather(H100, kv_gather_bytes(GQA, 1, LONG.seq_len, 1), size=4, stride=1)
    dense = layer_costs(GQA, H100, LONG, lay, trainer, overhead=0.0, moe=False)[0]
    reference = layer_costs(GQA, H100, LONG, lay, Options(), overhead=0.0, moe=False)[0]
    assert dense.attention_f == reference.attention_f and dense.attention_b == 2.5 * dense.attention_f
    assert trainer_cp_hidden(4) == 1 / 8
    sm = H100.hidden_comm_cost
    hidden = [dense.attention_f / 8, dense.attention_b / 8]
    expected = sum(max(per_layer - h, 0.0) + sm * min(per_layer, h) for h in hidden)
    assert evaluate(GQA, H100, LONG, lay, trainer).breakdown["cp_comm"] == pytest.approx(
        8 * GQA.n_layers * expected, rel=1e-12)
    assert evaluate(GQA, H100, LONG, lay).breakdown["cp_comm"] == pytest.approx(
        8 * 2 * GQA.n_layers * per_layer, rel=1e-12)


def test_trainer_prefers_cp_over_tp_at_131k_on_llama_8b():
    """Issue 38's case in the trainer's own physics (`phalanx plan` without --any-runtime):
    Llama-3.1-8B at 131,072 tokens, global batch 64, 64 H100s, recompute=full, dp=8. With the
    causal half of cp attention skipped (it was computed whole under the former explicit mask:
    97.3 s against tp's 64.0 s) cp=8 beats tp=8."""
    from phalanx.planner.options import trainer_options

    model, work = PRESETS["llama3-8b"], Workload(global_batch=64, seq_len=131072)
    best = {}
    for name, fix in (("cp", {"dp": 8, "cp": 8, "tp": 1, "pp": 1, "recompute": "full"}),
                      ("tp", {"dp": 8, "cp": 1, "tp": 8, "pp": 1, "recompute": "full"})):
        result = search(model, H100, work, world_size=64, fixed=fix, options=trainer_options("bf16", H100),
                        space=SearchSpace(phalanx_trainer=True), keep=1)
        best[name] = result.ranked[0]
    assert best["cp"].step_time_s < best["tp"].step_time_s


def test_trainer_ring_hides_each_step_behind_a_step_of_attention():
    """cp_ring=true (parallel/context_parallel_ring.py): the gather's bytes go around the ring
    in cp - 1 point-to-point steps of t_gather / (cp - 1) each (a ring all-gather's steps), each
    in flight while one of the cp equal steps of attention computes (every step is the same
    causal work with the load-balanced chunks: `ring_step_pairs`), forward and backward."""
    from phalanx import layout_rules as rules
    from phalanx.planner.stage_time import layer_costs

    cp = 4
    assert {rules.ring_step_pairs(LONG.seq_len, cp, 1, owner) for owner in (0, 2, 3)} == {2 * (LONG.seq_len // 8) ** 2}
    lay = Layout(dp=1, cp=cp, cp_ring=True, microbatches=8, mbs=1)
    trainer = Options(phalanx_trainer=True)
    step = comm.all_gather(H100, kv_gather_bytes(GQA, 1, LONG.seq_len, 1), size=cp, stride=1) / (cp - 1)
    dense = layer_costs(GQA, H100, LONG, lay, trainer, overhead=0.0, moe=False)[0]
    sm = H100.hidden_comm_cost
    expected = sum((cp - 1) * (max(step - a / cp, 0.0) + sm * min(step, a / cp))
                   for a in (dense.attention_f, dense.attention_b))
    ring = evaluate(GQA, H100, LONG, lay, trainer).breakdown["cp_comm"]
    assert ring == pytest.approx(8 * GQA.n_layers * expected, rel=1e-12)
    gather = evaluate(GQA, H100, LONG, lay.replace(cp_ring=False), trainer)
    assert ring < gather.breakdown["cp_comm"]
    # Memory: the ring fills the kept keys in place and sums one rank's key gradients at a time
    # (1 + 4 / cp copies of the whole sequence's keys and values) where the gather holds 4.
    ringed = evaluate(GQA, H100, LONG, lay, trainer).memory_breakdown["comm_buffers"]
    saved = gather.memory_breakdown["comm_buffers"] - ringed
    assert saved == pytest.approx((4 - 1 - 4 / cp) * gathered_kv_bytes(GQA, 1, LONG.seq_len, 1), rel=1e-9)


def test_planner_picks_gather_or_ring_per_layout(capsys):
    """The search prices both of the trainer's cp schedules for every cp layout and keeps the
    faster: Llama 3.1 8B at 32,768 tokens on dp=8 x cp=8 H100s (attention per step shorter than
    the whole gather, so the ring hides more of it) runs the ring; a latent-attention model keeps
    the gather (the ring refuses it), and so does a CPU cluster unless asked; `--cp-overlap`
    gives every cp layout the ring; the chosen plan is what `phalanx train --plan` runs."""
    def plans(fix: str, *extra: str) -> list[dict]:
        assert cli.run(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch",
                        "64", "--seq-len", "32768", "--fix", fix, "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["plans"]

    best = plans("dp=8,cp=8,recompute=full")[0]
    assert "cp_ring=true" in best["plan"] and best["cp_ring"] is True
    assert best["step_time_s"] < plans("dp=8,cp=8,recompute=full,cp_ring=false")[0]["step_time_s"]
    assert all("cp_ring=true" in row["plan"] for row in plans("cp=8,recompute=full", "--cp-overlap"))
    latent = search(PRESETS["tiny-dsv3"], H100, Workload(global_batch=2, seq_len=256), world_size=2,
                    fixed={"cp": 2}, space=SearchSpace(min_cp_chunk=1))
    assert latent.ranked and not any(e.layout.cp_ring for e in latent.ranked)
    # A CPU cluster keeps the gather unless asked: no transfer hides there, and the ring cost more CPU.
    local = CLUSTERS["local"]
    cpu = search(GQA, local, LONG, world_size=2, fixed={"cp": 2}, options=Options(phalanx_trainer=True))
    assert cpu.ranked and not any(e.layout.cp_ring for e in cpu.ranked)
    asked = search(GQA, local, LONG, world_size=2, fixed={"cp": 2, "cp_ring": True},
                   options=Options(phalanx_trainer=True))
    assert asked.ranked and all(e.layout.cp_ring for e in asked.ranked)
