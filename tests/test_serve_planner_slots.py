"""Expert slots in serving plans (issue 39): `--fix slots=S`, slots in the search, their memory,
the imbalance they remove (the balancer's own prediction for `--expert-load FILE|zipf:S`), the
`phalanx serve --expert-slots` a plan prints, and bad input. Torch-free, on presets; every
figure checked is worked out by hand in the test's docstring."""

from __future__ import annotations

import json

import pytest

from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.memory import param_counts
from phalanx.planner.serve.expert_load import expected_imbalance, zipf_load
from phalanx.planner.serve.memory import weight_bytes
from phalanx.planner.serve.rates import ServeLoad
from phalanx.planner.serve.search import search_serving
from phalanx.planner.serve.step import WEIGHT_BYTES, ServeLayout, step_time

SGLANG_DECODE = ["plan", "--serve", "--model", "deepseek-v3", "--cluster", "dgx-h100", "--gpus", "72",
                 "--isl", "2000", "--osl", "100", "--phase", "decode", "--weight-dtype", "fp8"]


def _cli(args, capsys):
    from phalanx.cli import main

    try:
        code = main(args)
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_sglang_72_gpu_decode_is_a_plan_with_its_slots(capsys):
    """SGLang's DeepSeek-V3 decode deployment (72 H100, attention DP 72, EP 72, 288 slots for
    256 experts: 4 per GPU) was "no serving layout" while ep had to divide the experts; with
    slots it is a plan, and the `phalanx serve` command it prints carries them."""
    code, out, err = _cli([*SGLANG_DECODE, "--fix", "tp=1,dp=72,ep=72,max_batch=256,slots=288", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)["plans"][0]
    assert (plan["dp"], plan["ep"], plan["tp"], plan["expert_slots"]) == (72, 72, 1, 288)
    assert "--expert-slots 288" in plan["serve"] and "--plan dp=72,ep=72" in plan["serve"]
    # Even loads over 4 slots per GPU: 32 experts replicated, 64 half-loads over 72 GPUs leave
    # at least 8 GPUs with four whole experts: 4 against a mean of 256 / 72, (4 - 3.556) / 3.556.
    assert plan["expert_imbalance"] == pytest.approx(4 / (256 / 72) - 1, abs=1e-9)
    assert plan["expert_imbalance_one_slot_each"] is None  # 72 does not divide 256: no such layout


def test_the_search_finds_slots_where_ep_does_not_divide_the_experts(capsys):
    """Without slots= pinned, ep=72 is still a layout: the fewest whole slots per GPU that hold
    256 experts, ceil(256 / 72) = 4, so 288."""
    code, out, err = _cli([*SGLANG_DECODE, "--fix", "tp=1,dp=72,ep=72,max_batch=256", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["plans"][0]["expert_slots"] == 288


def test_slot_memory_is_their_weights():
    """S slots over ep ranks hold S / ep experts' weights each: at fp8 (1 byte), DeepSeek-V3's
    58 MoE layers x (288 - 256) / 72 extra experts x 3 x 7168 x 2048 weights each."""
    model = MODELS["deepseek-v3"]
    plain = ServeLayout(dp=64, ep=64, weight_dtype="fp8")
    base = weight_bytes(model, ServeLayout(dp=72, ep=72, weight_dtype="fp8", slots=256))
    more = weight_bytes(model, ServeLayout(dp=72, ep=72, weight_dtype="fp8", slots=288))
    one_expert = 3 * model.dim * model.moe_ffn_dim
    assert more - base == pytest.approx(58 * (288 - 256) / 72 * one_expert * WEIGHT_BYTES["fp8"], rel=1e-12)
    # slots=0 is one slot per expert: the same bytes as slots=E.
    assert weight_bytes(model, plain) == weight_bytes(model, ServeLayout(dp=64, ep=64, weight_dtype="fp8", slots=256))
    assert param_counts(model).experts == 256 * one_expert


def test_balancer_imbalance_on_hand_worked_loads():
    """Four experts with zipf:1 loads 1, 1/2, 1/3, 1/4 (mean per rank 25/24) on 2 ranks:
    - 4 slots: the best split {1, 1/4} | {1/2, 1/3} puts 5/4 on one rank: 5/4 / (25/24) - 1 = 0.2;
    - 6 slots (3 per rank, two experts replicated, halves on each rank): the singles 1/3 and 1/4
      on one rank each leave (1 + 1/2) / 2 + 1/3 = 13/12 on the larger: 13/12 / (25/24) - 1 = 0.04.
    Even loads with one slot per expert that ep divides: 0, without calling the balancer."""
    load = zipf_load(1.0, 4)
    assert expected_imbalance(load, n_experts=4, slots=4, ep=2) == pytest.approx(0.2, abs=1e-9)
    assert expected_imbalance(load, n_experts=4, slots=6, ep=2) == pytest.approx(0.04, abs=1e-9)
    assert expected_imbalance(None, n_experts=256, slots=256, ep=64) == 0.0
    assert expected_imbalance(load, n_experts=4, slots=4, ep=1) == 0.0


def test_imbalance_slows_the_routed_experts_and_the_all_to_all():
    """The most loaded rank computes and exchanges 1 + imbalance times the mean rows: at a
    prefill step (GEMM-bound) the routed experts' time and the dispatch/combine grow with the
    imbalance; extra slots at no imbalance only add weights to read at a decode step."""
    model, cluster = MODELS["deepseek-v3"], CLUSTERS["dgx-h100"]
    even = ServeLayout(dp=8, ep=8, weight_dtype="fp8")
    hot = ServeLayout(dp=8, ep=8, weight_dtype="fp8", expert_imbalance=1.0)
    a = step_time(model, cluster, even, decodes=0, context=0, prefill_tokens=8192).breakdown
    b = step_time(model, cluster, hot, decodes=0, context=0, prefill_tokens=8192).breakdown
    assert b["weights_and_gemms"] > 1.3 * a["weights_and_gemms"]
    assert b["ep_comm"] > 1.5 * a["ep_comm"]
    more = ServeLayout(dp=8, ep=8, weight_dtype="fp8", slots=320)
    d_even = step_time(model, cluster, even, decodes=256, context=2048).breakdown["weights_and_gemms"]
    d_more = step_time(model, cluster, more, decodes=256, context=2048).breakdown["weights_and_gemms"]
    assert d_more > d_even


def test_a_skewed_load_buys_slots_and_they_pay():
    """Under a strong skew (zipf:1.2) DeepSeek-V3 decode at dp=ep=64: the search with slots
    free picks more than one slot per expert, its imbalance is lower than one slot per expert
    leaves, and it serves more tokens per GPU than the same layout pinned to slots=256."""
    model, cluster = MODELS["deepseek-v3"], CLUSTERS["dgx-h100"]
    load = ServeLoad(isl=1024, osl=1024, phase="decode", expert_load=zipf_load(1.2, 256))
    fix = {"tp": 1, "dp": 64, "ep": 64, "pp": 1}
    free = search_serving(model, cluster, load, gpus=64, fixed=fix, weight_dtype="fp8").ranked[0]
    pinned = search_serving(model, cluster, load, gpus=64, fixed={**fix, "slots": 256}, weight_dtype="fp8").ranked[0]
    assert free.layout.slots > 256
    assert free.layout.expert_imbalance < pinned.layout.expert_imbalance
    # The imbalance the replicas remove: the same ep's with one slot per expert, as pinned.
    assert free.imbalance_one_slot_each == pytest.approx(pinned.layout.expert_imbalance)
    assert free.rates.output_tps_gpu > pinned.rates.output_tps_gpu


def test_serve_command_places_the_priced_skew(tmp_path, capsys):
    """A plan priced for a load file starts `phalanx serve` from that file's placement; for a
    zipf skew it re-places from measured loads (the engine's only way to the same placement)."""
    table = tmp_path / "load.json"
    table.write_text(json.dumps([[8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]] * 6))
    base = ["plan", "--serve", "--model", "small-moe", "--cluster", "dgx-h100", "--gpus", "4", "--isl", "100",
            "--osl", "100", "--fix", "tp=1,dp=4,ep=4", "--json"]
    code, out, err = _cli([*base, "--expert-load", str(table)], capsys)
    assert code == 0, err
    plan = json.loads(out)["plans"][0]
    assert f"--expert-placement {table}" in plan["serve"] and "--expert-slots" in plan["serve"]
    assert plan["expert_load"] == str(table)
    code, out, err = _cli([*base, "--expert-load", "zipf:1"], capsys)
    assert code == 0, err
    assert "--rebalance-every 64" in json.loads(out)["plans"][0]["serve"]
    # One layer's loads for a 6-MoE-layer model: priced, but no placement phalanx serve could load.
    table.write_text(json.dumps([[8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]]))
    code, out, err = _cli([*base, "--expert-load", str(table)], capsys)
    assert code == 0, err
    serve = json.loads(out)["plans"][0]["serve"]
    assert "--expert-placement" not in serve and "--rebalance-every 64" in serve


@pytest.mark.parametrize("args, says", [
    (["--model", "deepseek-v3", "--fix", "slots=100"], "--fix slots=100 is fewer slots than the 256 experts"),
    (["--model", "llama3-8b", "--fix", "slots=8"], "needs a mixture-of-experts model"),
    (["--model", "deepseek-v3", "--fix", "dp=8,ep=8,slots=260"], "no serving layout of 8 GPUs matches"),
    (["--model", "deepseek-v3", "--expert-load", "zipf:x"], "zipf:S takes a number S >= 0"),
    (["--model", "deepseek-v3", "--expert-load", "zipf:-1"], "the zipf exponent must be within 0 and 4"),
    (["--model", "deepseek-v3", "--expert-load", "/nonexistent/load.json"], "--expert-load /nonexistent/load.json: load file"),
    (["--model", "llama3-8b", "--expert-load", "zipf:1"], "has no routed experts"),
])
def test_bad_slots_and_loads_are_one_line(args, says, capsys):
    """Each bad slot count or expert load: one line on stderr, exit status 2."""
    from phalanx.cli import main

    base = ["plan", "--serve", "--cluster", "dgx-h100", "--gpus", "8", "--isl", "100", "--osl", "100",
            "--weight-dtype", "fp8"]
    with pytest.raises(SystemExit) as exit:
        main([*base, *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1 and says in lines[0], lines


@pytest.mark.parametrize("text, says", [
    ("", "is not JSON"), ("[[1, 2]", "is not JSON"), ('[[1, "a"]]', "rectangular [layers][experts] table"),
    ("[]", "a [layers][experts] table"), ("[[0, 0, 0, 0, 0, 0, 0, 0]]", "no expert carries any load"),
    ("[[1, 1, 1, 1, 1, 1, 1, -1]]", "negative values"),
])
def test_bad_load_files_are_one_line(tmp_path, capsys, text, says):
    """Each bad load table: one line naming the flag and the file, exit status 2."""
    from phalanx.cli import main

    table = tmp_path / "load.json"
    table.write_text(text)
    with pytest.raises(SystemExit) as exit:
        main(["plan", "--serve", "--model", "small-moe", "--cluster", "dgx-h100", "--gpus", "4", "--isl", "100",
              "--osl", "100", "--expert-load", str(table)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1 and f"--expert-load {table}" in lines[0] and says in lines[0], lines


def test_a_load_file_of_other_experts_is_one_line(tmp_path, capsys):
    """A load table of 4 experts for an 8-expert model names both counts."""
    from phalanx.cli import main

    table = tmp_path / "load.json"
    table.write_text(json.dumps([[1.0, 2.0, 3.0, 4.0]]))
    with pytest.raises(SystemExit) as exit:
        main(["plan", "--serve", "--model", "small-moe", "--cluster", "dgx-h100", "--gpus", "4", "--isl", "100",
              "--osl", "100", "--expert-load", str(table)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1 and "4 experts per layer" in lines[0] and "8" in lines[0], lines
