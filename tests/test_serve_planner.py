"""The serving planner's laws (issue 23), on presets, without torch: each checks a direction
the step model and the search must keep whatever their constants, so none can pass by a
hard-coded figure."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.serve.rates import ServeLoad
from phalanx.planner.serve.search import search_serving
from phalanx.planner.serve.step import ServeLayout, decode_step_time, step_time


def _best(model, cluster, load, gpus, fixed=None, **kw):
    result = search_serving(MODELS[model], cluster, load, gpus=gpus, fixed=fixed or {}, **kw)
    assert result.ranked, "nothing fits"
    return result.ranked[0]


def test_tighter_tpot_never_picks_a_larger_decode_batch():
    """Sweeping the TPOT target down, the chosen plan's running batch per dp rank never grows
    (a tighter target can only be met with fewer sequences sharing a step)."""
    batches = []
    for tpot in (200, 80, 40, 25, 15, 10):
        plan = _best("llama3-70b", CLUSTERS["dgx-h100"], ServeLoad(isl=1000, osl=1000, tpot_ms=tpot), 8,
                     weight_dtype="fp8")
        batches.append(plan.rates.batch)
    assert all(b2 <= b1 for b1, b2 in zip(batches, batches[1:])), batches
    assert batches[-1] < batches[0], batches


def test_more_kv_memory_never_lowers_throughput():
    """The same GPUs with more memory hold more sequences, so the best throughput never falls."""
    load = ServeLoad(isl=2000, osl=500)
    out = []
    for gib in (40, 80, 120, 160):
        cluster = dataclasses.replace(CLUSTERS["dgx-h100"], memory_gib=float(gib))
        out.append(_best("llama3-70b", cluster, load, 4).rates.output_tps_gpu)
    assert all(b >= a for a, b in zip(out, out[1:])), out
    assert out[-1] > out[0], out


@pytest.mark.parametrize("model", ["llama3-8b", "deepseek-v3"])
def test_tpot_grows_with_batch_and_context_at_a_fixed_layout(model):
    """Grouped-query and latent attention alike: more sequences or longer contexts in a
    decode step read more KV cache (and weights of more experts), never less."""
    cluster = CLUSTERS["dgx-h200"]
    layout = ServeLayout(dp=8, ep=8, weight_dtype="fp8") if model == "deepseek-v3" else ServeLayout(tp=2)
    by_batch = [decode_step_time(MODELS[model], cluster, layout, batch=b, context=2048) for b in (1, 8, 64, 256)]
    by_context = [decode_step_time(MODELS[model], cluster, layout, batch=32, context=c) for c in (128, 1024, 8192, 32768)]
    assert all(b > a for a, b in zip(by_batch, by_batch[1:])), by_batch
    assert all(b > a for a, b in zip(by_context, by_context[1:])), by_context


def test_latent_attention_reads_its_latent_not_per_head_keys():
    """DeepSeek-V3's decode KV read is its 576-value latent per layer: a GQA model with the
    same shape but 128 full KV heads would read ~71x more per token."""
    ds = MODELS["deepseek-v3"]
    gqa = ds.replace(kv_lora_rank=0, q_lora_rank=0, qk_rope_head_dim=0, qk_nope_head_dim=0, v_head_dim=0,
                     head_dim=128)
    cluster, layout = CLUSTERS["dgx-h200"], ServeLayout(dp=8, ep=8)
    kv = lambda m: step_time(m, cluster, layout, decodes=64, context=8192).breakdown["attention_decode"]  # noqa: E731
    assert kv(gqa) > 20 * kv(ds)


def test_nvlink_rack_beats_8_gpu_nodes_when_dispatch_dominates():
    """DeepSeek-V3 decode over 32 GPUs with wide EP: on 8-GPU nodes the dispatch and combine
    leave through each GPU's NIC, in a 72-GPU NVLink domain they stay on NVLink; the same
    layout serves more tokens per GPU on the rack."""
    load = ServeLoad(isl=1024, osl=1024, phase="decode")
    fixed = {"dp": 32, "ep": 32, "tp": 1, "pp": 1}
    rack = dataclasses.replace(CLUSTERS["dgx-h100"], name="h100-rack", fast_domain=72, devices_per_node=72,
                               intra_bw_gbs=CLUSTERS["dgx-h100"].intra_bw_gbs)
    on_nodes = _best("deepseek-v3", CLUSTERS["dgx-h100"], load, 32, fixed, weight_dtype="fp8")
    on_rack = _best("deepseek-v3", rack, load, 32, fixed, weight_dtype="fp8")
    assert on_nodes.rates.breakdown["ep_comm"] > 2 * on_rack.rates.breakdown["ep_comm"]
    assert on_rack.rates.output_tps_gpu > on_nodes.rates.output_tps_gpu


@pytest.mark.parametrize("args, says", [
    (["--global-batch", "8"], "--global-batch belongs to training plans"),
    (["--seq-len", "8"], "--seq-len belongs to training plans"),
    (["--dtype", "bf16"], "--dtype belongs to training plans"),
    (["--fix", "zero=1"], "--fix zero= is a training knob"),
    (["--fix", "schedule=1f1b"], "--fix schedule= is a training knob"),
    (["--fix", "tq=2"], "unknown serving key 'tq'"),
    (["--fix", "tp=2,tp=4"], "--fix key 'tp' is given twice"),
    (["--fix", "tp"], "--fix item 'tp' is not of the form key=value"),
    (["--fix", "tp=3"], "no serving layout of 8 GPUs matches --fix tp=3"),
    (["--weight-dtype", "fp4"], "has no fp4 tensor cores"),
    (["--rate", "-1"], "--rate=-1.0 must be a positive number"),
    (["--isl", "0"], "--isl=0 must be at least 1"),
])
def test_bad_input_is_one_line(args, says, capsys):
    """`phalanx plan --serve` with a bad flag: one line on stderr, exit status 2."""
    from phalanx.cli import main

    base = ["plan", "--serve", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--isl", "100",
            "--osl", "100"]
    with pytest.raises(SystemExit) as exit:
        main([*base, *args])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1 and says in lines[0], err


def test_json_keys_serve_command_and_no_torch(tmp_path):
    """Several clusters in one call, the issue's JSON keys; neither `plan --serve` nor
    `simulate --serve` imports torch."""
    code = (
        "import sys, io, contextlib, json\n"
        "from phalanx.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    try:\n"
        "        main(['plan', '--serve', '--model', 'deepseek-v3', '--cluster', 'gb200-nvl72', '--cluster', 'dgx-b200',\n"
        "              '--gpus', '8', '--isl', '1024', '--osl', '1024', '--rate', '2', '--tpot-ms', '100',\n"
        "              '--weight-dtype', 'fp4', '--json'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "    try:\n"
        "        main(['simulate', '--serve', '--model', 'tiny', '--cluster', 'dgx-h100', '--gpus', '1', '--isl', '32',\n"
        f"              '--osl', '8', '--rate', '5', '--rates', '5', '--requests', '5', '--out', {str(tmp_path)!r}])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "buf.seek(0); text = buf.getvalue(); text = text[:text.rindex('}') + 1]\n"
        "print(text)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert [c["cluster"] for c in out["clusters"]] == ["gb200-nvl72", "dgx-b200"]
    plan = out["clusters"][0]["plans"][0]
    for key in ("tp", "ep", "dp", "pp", "instances", "prefill_gpus", "decode_gpus", "max_batch", "max_batch_tokens",
                "ttft_ms", "tpot_ms_p50", "tpot_ms_p99", "output_tokens_per_s_per_gpu", "input_tokens_per_s_per_gpu",
                "goodput_req_per_s", "serve"):
        assert key in plan, key
    assert plan["serve"].startswith("phalanx serve --model deepseek-v3")
    assert plan["tpot_ms_p99"] >= plan["tpot_ms_p50"] > 0
    assert plan["dp"] * plan["tp"] * plan["pp"] * plan["instances"] == 8
    assert "fp4 weights" in plan["not_in_phalanx_serve"]


def test_disaggregated_plans_split_the_gpus(capsys):
    """`--disaggregate on`: every plan is a prefill side and a decode side of whole
    allocations that add up to --gpus, with the prefill side's own `phalanx serve` command;
    its TPOT is the decode side's step with no prompt in it. `off`: colocated plans only."""
    from phalanx.cli import main

    argv = ["plan", "--serve", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "16", "--isl", "4000",
            "--osl", "500", "--weight-dtype", "fp8", "--json"]
    for mode in ("on", "off"):
        with pytest.raises(SystemExit) as exit:
            main([*argv, "--disaggregate", mode])
        assert exit.value.code == 0
        plans = json.loads(capsys.readouterr().out)["plans"]
        if mode == "on":
            split = plans
            assert all(p["prefill_gpus"] + p["decode_gpus"] == 16 and p["prefill_gpus"] % 8 == 0 for p in plans)
            assert all(p["prefill"]["serve"].startswith("phalanx serve") for p in plans)
            assert all("prefill/decode disaggregation" in p["not_in_phalanx_serve"] for p in plans)
        else:
            colocated = plans
    dec = split[0]
    layout = ServeLayout(tp=dec["tp"], pp=dec["pp"], dp=dec["dp"], ep=dec["ep"], weight_dtype="fp8")
    alone = decode_step_time(MODELS["llama3-70b"], CLUSTERS["dgx-h100"], layout, batch=dec["running_batch"],
                             context=4000 + 500 / 2)
    assert dec["tpot_ms_p50"] == pytest.approx(alone * 1e3, rel=1e-9)  # no prompt tokens in a decode step
    assert colocated and all(p["prefill_gpus"] == p["decode_gpus"] == 16 for p in colocated)


def test_an_overloaded_plan_shows_no_ttft(capsys):
    """Past its capacity a plan's queue grows without bound: the table's TTFT column says
    `overloaded` (as the JSON's `overloaded` does), not the unloaded figure; an unloaded one
    shows its TTFT."""
    from phalanx.cli import main

    base = ["plan", "--serve", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--isl", "128",
            "--osl", "64", "--top", "3", "--disaggregate", "off"]
    for rate, overloaded in (("1e300", True), ("0.01", False)):
        with pytest.raises(SystemExit):
            main([*base, "--rate", rate])
        rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isdigit() and "layouts" not in line]
        assert rows and all(("overloaded" in row) == overloaded for row in rows), rows


def test_fp4_gemms_run_at_the_published_share_of_fp8_not_the_datasheet_ratio():
    """An NVFP4 GEMM is priced at NVFP4_OVER_FP8 times the fp8 rate (NVIDIA's published 1.5-2.2x),
    never above the datasheet's fp4 peak; a cluster with fp4 units and no fp8 figure keeps its
    datasheet fp4 peak. So a compute-bound fp4 prefill is faster than fp8, but by less than 2x."""
    from phalanx.planner.serve.step import NVFP4_OVER_FP8, gemm_peak

    b200 = CLUSTERS["dgx-b200"]
    fp8, fp4 = gemm_peak(b200, "fp8", 8), gemm_peak(b200, "fp4", 8)
    assert fp4 == pytest.approx(fp8 * NVFP4_OVER_FP8)
    assert fp8 < fp4 < fp8 * b200.fp4_tflops / b200.fp8_tflops
    no_fp8 = dataclasses.replace(b200, fp8_tflops=0.0)
    assert gemm_peak(no_fp8, "fp4", 8) == pytest.approx(gemm_peak(b200, "bf16", 8) * b200.fp4_tflops / b200.peak_tflops)
    slow_fp4 = dataclasses.replace(b200, fp4_tflops=b200.fp8_tflops * 1.2)
    assert gemm_peak(slow_fp4, "fp4", 8) == pytest.approx(fp8 * 1.2)
    model = MODELS["llama3-70b"]
    layout = dict(tp=1)
    t8 = step_time(model, b200, ServeLayout(weight_dtype="fp8", kv_dtype="fp8", **layout), decodes=0, context=0,
                   prefill_tokens=8192).seconds
    t4 = step_time(model, b200, ServeLayout(weight_dtype="fp4", kv_dtype="fp8", **layout), decodes=0, context=0,
                   prefill_tokens=8192).seconds
    assert t8 / 2 < t4 < t8


def test_plan_and_simulate_take_serve_as_their_registered_second_grammar():
    """`plan --serve` and `simulate --serve` are the `plan` and `simulate` parsers' own second
    grammar (phalanx/cli.py registers it), not an argv scanned before parsing: the parsed
    command is `plan`, runs the serving planner, and the training grammar is untouched."""
    from phalanx.cli import build_parser
    from phalanx.planner.cli import run_plan
    from phalanx.planner.serve.cli import run_serve_plan
    from phalanx.planner.serve.sim_report import run_serve_simulate

    parser = build_parser()
    base = ["--model", "llama3-8b", "--gpus", "8", "--isl", "100", "--osl", "10"]
    args = parser.parse_args(["plan", *base, "--serve"])
    assert (args.command, args.func, args.isl) == ("plan", run_serve_plan, 100)
    args = parser.parse_args(["simulate", "--serve", *base, "--rate", "2"])
    assert (args.command, args.func, args.rate) == ("simulate", run_serve_simulate, 2.0)
    args = parser.parse_args(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--seq-len", "64"])
    assert (args.command, args.func, args.serve) == ("plan", run_plan, False)
    with pytest.raises(SystemExit):  # the serving grammar's own flags belong to it alone
        parser.parse_args(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--seq-len", "64",
                           "--isl", "100"])
