"""benchmarks/device_check.sh: its dry run (every part at tiny sizes on the CPU) writes a JSON
and a Markdown table with every part and a status, and the figures each part's reader finds in
its benchmark's output, so a changed output line or a broken command fails here and not on the
first GPU; without a CUDA device the script refuses in one line (exit 2); a spent budget runs
nothing more and says so.

The dry run is ~45 s of CPU (its parts forked from one process that imported torch once,
benchmarks/device_check_forks.py: 66 s when each was its own interpreter); its wall time
follows the machine's load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from device_check_parts import NOT_IN_BUILD, PARTS, read_serve, read_tests  # noqa: E402


def _script(*args: str, cuda_visible: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    return subprocess.run(["bash", str(ROOT / "benchmarks/device_check.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=1500)


def test_without_a_cuda_device_it_says_so_in_one_line_and_exits_2(tmp_path):
    done = _script("--out", str(tmp_path / "out"), cuda_visible="")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("device_check: no CUDA device here")
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(1500)
def test_dry_run_writes_every_part_with_its_figures(tmp_path):
    done = _script("--dry-run", "--out", str(tmp_path / "check"), "--budget-s", "1400")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "check" / "device_check.json").read_text())
    parts = {record["name"]: record for record in result["parts"]}
    assert sorted(parts) == sorted(p.name for p in PARTS)
    for name, record in parts.items():
        assert record["status"] == "ok" or record["status"].startswith((NOT_IN_BUILD, "dry run:")), (name, record)
    figures = {name: record.get("figures", {}) for name, record in parts.items()}

    tests = figures["cuda_tests"]  # on a CPU every CUDA test is collected and skipped
    assert tests["skipped"] >= 17 and tests["passed"] == tests["failed"] == tests["errors"] == 0
    train = figures["train_bf16"]
    assert train["model"] == "bench-tiny" and train["tokens_per_s"] > 0 and train["peak_mem_mb"] > 0
    planner = parts["train_bf16"]["planner"]
    assert planner["cluster"] == "local" and planner["tokens_per_s"] > 0 and planner["memory_gib"] > 0
    assert "energy_j_per_step" not in train and planner["energy_j_per_step"] is None  # CPU: none read; `local`: no power
    assert (tmp_path / "check" / "bench-tiny.json").exists()  # the planner's command can be rerun
    generate = figures["generate"]
    assert generate["same_tokens"] is True and generate["prefill_ratio"] > 0 and generate["decode_ratio"] > 0
    serve = figures["serve"]  # serve_load.py --quick: 4 requests at once, the three baselines beside
    assert set(serve["ratios"]) == {"a", "b", "c"} and all(ratio > 0 for ratio in serve["ratios"].values())
    assert serve["arms"]["phalanx serve, closed loop of 4"]["tokens_per_s"] > 0
    match = figures["match"]
    assert [c["patterns"] for c in match["cases"]] == [100, 100]
    assert all(c["counts_agree"] and c["serial_ratio"] > 0 for c in match["cases"])
    assert isinstance(match["claim_10x_serial_met"], bool)
    assert figures["blur"]["max_diff"] < 1e-5 and figures["blur"]["scipy_s"] > 0
    attention = figures["attention"]
    assert [p["seq"] for p in attention["attention_by_seq"]] == [128, 512] and attention["matmul_efficiency"] > 0
    assert attention["planner_attention_efficiency"] > 0 and attention["planner_matmul_efficiency"] > 0
    (row,) = figures["planner_memory"]["rows"]
    assert row["model"] == "tiny" and row["total"]["measured_mib"] > 0 and row["total"]["predicted_mib"] > 0

    table = (tmp_path / "check" / "device_check.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| #")]
    assert len(rows) == len(PARTS)
    for part in PARTS:
        assert f"| {part.section} | {part.title} | {parts[part.name]['status']} |" in table
    assert "===== cuda_tests" in (tmp_path / "check" / "device_check.log").read_text()


def test_a_spent_budget_runs_nothing_more(tmp_path):
    from device_check import main

    assert main(["--dry-run", "--out", str(tmp_path), "--budget-s", "5", "--only", "cuda_tests,blur"]) == 0
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert [(r["name"], r["status"]) for r in result["parts"]] == [
        ("cuda_tests", "not run: the 5 s budget was spent"), ("blur", "not run: the 5 s budget was spent")]


def test_readers_of_failing_tests_and_serving_lines():
    text = "FAILED tests/test_cuda_x.py::test_a - AssertionError\nERROR tests/test_cuda_y.py\n" \
           "1 failed, 3 passed, 2 skipped, 1 error in 12.50s\n"
    assert read_tests(text) == {"passed": 3, "failed": 1, "skipped": 2, "errors": 1, "deselected": 0,
                                "not_passed": ["tests/test_cuda_x.py::test_a", "tests/test_cuda_y.py"]}
    assert read_tests("no tests ran in 0.01s") == {}
    stopped = "tests/test_cuda_a.py::test_x PASSED    [ 50%]\ntests/test_cuda_a.py::test_y FAILED    [100%]\n"
    assert read_tests(stopped) == {"passed": 1, "failed": 1, "skipped": 0, "errors": 0, "deselected": 0,
                                   "not_passed": ["tests/test_cuda_a.py::test_y"], "incomplete": True}
    # serve_load.py's table and ratios as it prints them; transformers' log lines between them are not rows.
    served = ("llama hidden 512, 4 layers, 32 requests\n"
              f"{'arm':58} {'out tok/s':>9} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} {'goodput':>8}\n"
              f"{'phalanx serve, closed loop of 32':58} {175.0:>9.1f} {2.261:>9.3f} {3.547:>7.3f} {0.106:>9.3f} "
              f"{0.230:>7.3f} {0.077:>8.3f}\n"
              "2026-12-01 20:05:54,205 - ContinuousBatchingLogger - WARNING - `eos_token_id` not set\n"
              f"{'(b) transformers static padded batch':58} {128.1:>9.1f} {'-':>9} {'-':>7} {'-':>9} {'-':>7} {'-':>8}\n"
              "phalanx closed loop / (a): throughput 3.51x, TTFT p99 3.547 s against 43.460 s\n"
              "phalanx closed loop / (b): throughput 1.37x\n")
    assert read_serve(served) == {"arms": {
        "phalanx serve, closed loop of 32": {"tokens_per_s": 175.0, "ttft_p50": 2.261, "ttft_p99": 3.547, "tpot_p50": 0.106,
                                             "tpot_p99": 0.23, "goodput_req_per_s": 0.077},
        "(b) transformers static padded batch": {"tokens_per_s": 128.1}}, "ratios": {"a": 3.51, "b": 1.37}}
    assert read_serve("Traceback (most recent call last):\n") == {}


def test_attention_reader_takes_the_slope_or_the_longer_point():
    """The slope between two sequence lengths, or, when timing noise made the longer one no
    slower, that point's own rate (attention_efficiency.py says which)."""
    from device_check_parts import read_attention

    tail = ("matmul efficiency (8192^3): 0.712; the planner's: 0.800 (measured / planner 0.89)\n")
    points = "causal attention seq   8192:    401.2 TFLOP/s, 0.406 of peak (2.10 ms)\n"
    slope = read_attention(points + "attention efficiency (slope 8192 -> 32768): 0.455; the planner's: 0.500 (x)\n" + tail)
    assert slope["attention_efficiency"] == 0.455 and slope["attention_by_seq"] == [{"seq": 8192, "of_peak": 0.406}]
    alone = read_attention("attention efficiency (seq 512 alone: the longer sequence was not slower): 0.010; "
                           "the planner's: 0.500 (x)\n" + tail)
    assert alone["attention_efficiency"] == 0.01 and alone["matmul_efficiency"] == 0.712


def test_readers_of_the_lines_only_a_gpu_prints_and_their_table_row():
    """The lines the scripts print with --device cuda (kernel-only times, MFU, the NCCL
    check, the allocator's peak), written as their f-strings print them."""
    from device_check_parts import read_blur, read_match, read_memory, read_train_arm
    from device_check_report import markdown

    train = read_train_arm("eager")("NVIDIA H200 | NCCL all_reduce on 1 rank: [1.0, 1.0, 1.0, 1.0]\n"
                                    "bench-1b: 8 x 2048 tokens per step, median 61,234 tokens/s, 412.50 model TFLOP/s, "
                                    "peak memory 48,120 MB\nMFU = 41.7% of 989 TFLOP/s\n")
    assert train["tokens_per_s"] == 61234 and train["mfu"] == pytest.approx(0.417) and train["peak_tflops"] == 989
    assert train["nccl_all_reduce"] == "[1.0, 1.0, 1.0, 1.0]" and list(train["arms"]) == ["eager"]
    # A line per arm (eager, compile, float8 in one run) and the ratios between them; a run
    # stopped before its float8 arm still reports the arms it printed.
    arms = ("bench-1b: 8 x 2048 tokens per step, bf16, AdamW, 20 steps per arm (median after 3), torch 2.11\n"
            f"  {'eager':8s} {61234:12,.0f} tokens/s  {412.5:8.3f} model TFLOP/s  peak memory 48,120 MB  "
            "MFU 41.7% of 989 TFLOP/s\n"
            f"  {'compile':8s} {70000:12,.0f} tokens/s  {471.6:8.3f} model TFLOP/s  peak memory 40,000 MB  "
            "MFU 47.7% of 989 TFLOP/s\ncompile / eager  = 1.14x  (torchtitan: 1.16x)\n")
    compiled = read_train_arm("compile")(arms)
    assert compiled["tokens_per_s"] == 70000 and compiled["ratios"] == {"compile / eager": 1.14}
    stopped = read_train_arm("float8")(arms + "Traceback ...\n")
    assert "tokens_per_s" not in stopped and list(stopped["arms"]) == ["eager", "compile"]
    match = read_match("phalanx: --device cuda --nproc 1, 16 torch threads in-process; times are the best of 2\n\n"
                       "stdlib 1.0 MB, 1000 patterns, phalanx algorithm wu-manber:\n"
                       f"  {'phalanx':28s} {0.021:8.3f} s  428686 matches\n"
                       f"  {'phalanx kernel only (GPU)':28s} {0.004:8.3f} s\n"
                       f"  {'serial Wu-Manber (Python)':28s} {3.946:8.3f} s  ratio {3.946 / 0.021:6.2f}\n"
                       f"  {'pyahocorasick':28s} not installed\n")
    (case,) = match["cases"]
    assert case["kernel_s"] == 0.004 and case["serial_ratio"] == 187.9 and match["claim_10x_serial_met"] is True
    blur = read_blur(f"  {'scipy gaussian_filter':28s} {1.348:8.3f} s\n"
                     f"  {'phalanx, 1 process':28s} {0.2:8.3f} s  ratio scipy/phalanx {6.74:5.2f}  max |diff| 3.0e-07\n"
                     f"  {'phalanx kernel only (GPU)':28s} {0.01:8.3f} s\n")
    assert blur["kernel_s"] == 0.01 and round(blur["scipy_ratio_kernel"], 1) == 134.8
    memory = read_memory("decide   1 small    microbatches=1" + " " * 37 + "parameters 9.4/9.4 (-0%)  total "
                         "107.3/100.2 (+7%)  allocator 131.5  [4 s]\n")
    assert memory["rows"][0]["allocator_mib"] == 131.5 and memory["rows"][0]["total"]["error"] == 0.07
    planner = {"cluster": "dgx-h200", "tokens_per_s": 86562.0, "mfu": 0.501, "step_time_s": 0.19,
               "step_time_band": 0.21, "memory_gib": 40.9, "command": "python -m phalanx plan ..."}
    result = {"environment": {"device": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "commit": "abc",
                              "dry_run": False}, "started": "now", "budget_s": 540, "wall_s": 400, "parts": [
        {"name": "train_bf16", "section": 2, "title": "training, bf16", "status": "ok", "seconds": 40, "cpu_s": 30,
         "figures": train, "planner": planner},
        {"name": "match", "section": 4, "title": "match", "status": "ok", "seconds": 50, "figures": match},
        {"name": "blur", "section": 4, "title": "blur", "status": "timed out", "seconds": 60, "figures": blur,
         "output_tail": ["last | line"]},
        {"name": "planner_memory", "section": 5, "title": "memory", "status": "ok", "seconds": 20, "figures": memory}]}
    result["parts"].append({"name": "train_bf16_compile_float8", "section": 2, "title": "training, f8", "status": "failed",
                            "seconds": 90, "figures": stopped, "planner": planner, "output_tail": ["Error"]})
    table = markdown(result)
    assert "| 2 | training, bf16 | ok | 40 (30) | 8 x 2048: eager 61,234 tokens/s, 412.5 TFLOP/s, MFU 41.7% of 989" in table
    assert ("8 x 2048: eager 61,234 tokens/s, 412.5 TFLOP/s, MFU 41.7% of 989, peak 48,120 MB; compile 70,000 tokens/s, "
            "471.6 TFLOP/s, MFU 47.7% of 989, peak 40,000 MB; no float8 arm; compile / eager = 1.14x; last line: Error") in table
    assert "86,562 tokens/s (±21%), predicted/measured 1.41, MFU 50.1%, 40.9 GiB (measured peak 47 GiB)" in table
    assert "(kernel 0.004 s), 187.9x serial (986.5x kernel only); claim >= 10x serial" in table
    assert "| 4 | blur | timed out | 60 (-) |" in table and "last line: last \\| line |" in table
    assert "allocator peak 131.5 MiB" in table


def test_the_gpus_measured_energy_stands_beside_the_planners_prediction():
    """On CUDA the training script's arm line ends with the energy NVML's counter measured over
    the steps after warm-up (single_device_throughput.energy_line); the reader takes it back
    and the row shows it beside the planner's energy for the same model, layout and preset
    (here the dgx-h200 plan's 132.5 J/step at its 0.189 s step), with their ratio. Where the
    counter could not be read, the script's one line says why and the row repeats it."""
    from device_check_parts import read_train_arm
    from device_check_report import markdown
    from single_device_throughput import energy_line, measured_energy

    records = [{"energy_j": joules, "step_time_s": 0.25} for joules in (140.0, 150.0, 160.0)]
    energy = measured_energy(records, tokens_per_step=8 * 2048)
    assert energy == {"energy_j_per_step": 150.0, "energy_j_per_token": 150.0 / 16384, "watts": 600.0}
    assert measured_energy(records + [{"step_time_s": 0.25}], tokens_per_step=16384) == {}  # a step without: none
    head = "bench-1b: 8 x 2048 tokens per step, bf16, AdamW, 20 steps per arm (median after 3), torch 2.11\n"
    line = (f"  {'eager':8s} {61234:12,.0f} tokens/s  {412.5:8.3f} model TFLOP/s  peak memory 48,120 MB  "
            "MFU 41.7% of 989 TFLOP/s")
    train = read_train_arm("eager")(head + line + energy_line(energy) + "\n")
    assert train["energy_j_per_step"] == 150.0 and train["watts"] == 600.0
    assert train["energy_j_per_token"] == pytest.approx(150.0 / 16384, rel=1e-3)  # printed to 4 digits
    unmeasured = read_train_arm("eager")(head + line + "\n  eager: energy not measured: no pynvml module (pip install "
                                         "nvidia-ml-py, or phalanx[gpu])\n")
    assert "energy_j_per_step" not in unmeasured and unmeasured["arms"]["eager"]["energy_note"].startswith("no pynvml")
    planner = {"cluster": "dgx-h200", "tokens_per_s": 86562.0, "mfu": 0.501, "step_time_s": 0.1893,
               "step_time_band": 0.21, "memory_gib": 34.95, "energy_j_per_step": 132.49,
               "energy_j_per_token": 0.008087, "command": "python -m phalanx plan ..."}
    environment = {"device": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "commit": "abc", "dry_run": False}
    rows = [{"name": "train_bf16", "section": 2, "title": "training, bf16", "status": "ok", "seconds": 40,
             "figures": figures, "planner": planner} for figures in (train, unmeasured)]
    measured, not_measured = (markdown({"environment": environment, "started": "now", "budget_s": 540, "parts": [row]})
                              for row in rows)
    assert "peak 48,120 MB, 150.0 J/step, 0.00915 J/token (600 W) |" in measured
    assert "35 GiB (measured peak 47 GiB), 132.5 J/step, 0.00809 J/token (700 W), energy predicted/measured 0.88 on dgx-h200" \
        in measured
    assert "peak 48,120 MB, energy not measured: no pynvml module (pip install nvidia-ml-py, or phalanx[gpu]) |" in not_measured
    assert "132.5 J/step, 0.00809 J/token (700 W) on dgx-h200" in not_measured
    local = {**planner, "cluster": "local", "energy_j_per_step": None, "energy_j_per_token": None}
    table = markdown({"environment": environment, "started": "now", "budget_s": 540,
                      "parts": [{**rows[0], "planner": local}]})
    assert "no energy (the cluster has no power figures) on local" in table
