"""benchmarks/device_check.sh: its dry run (every part at tiny sizes on the CPU) writes a JSON
and a Markdown table with every part and a status, and the figures each part's reader finds in
its benchmark's output, so a changed output line or a broken command fails here and not on the
first GPU; without a CUDA device the script refuses in one line (exit 2); a spent budget runs
nothing more and says so.

The dry run is ~40 s of CPU (six subprocesses that import torch, one of them transformers);
its wall time follows the machine's load.
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
    assert (tmp_path / "check" / "bench-tiny.json").exists()  # the planner's command can be rerun
    generate = figures["generate"]
    assert generate["same_tokens"] is True and generate["prefill_ratio"] > 0 and generate["decode_ratio"] > 0
    match = figures["match"]
    assert [c["patterns"] for c in match["cases"]] == [100, 100]
    assert all(c["counts_agree"] and c["serial_ratio"] > 0 for c in match["cases"])
    assert isinstance(match["claim_10x_serial_met"], bool)
    assert figures["blur"]["max_diff"] < 1e-5 and figures["blur"]["scipy_s"] > 0
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
    assert read_serve("warm-up\n  decode 1,234 tokens/s\n  ratio phalanx / baseline = 1.1\n") == {
        "lines": ["decode 1,234 tokens/s", "ratio phalanx / baseline = 1.1"]}
