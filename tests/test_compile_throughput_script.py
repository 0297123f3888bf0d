"""benchmarks/single_device_throughput.py, the GPU session's script, runs on CPU in its tiny size.

Its dry run trains every arm (eager, compiled, compiled float8) for 4 steps and prints each
arm's tokens/s and both ratios beside torchtitan's figures. The compiled arms use the
`aot_eager` backend here (tests/test_compile.py says why); the figures themselves are not
checked (no timing assertions), only that every arm ran and reported.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.parallel.compile import BACKEND_ENV

pytest.importorskip("torchao.float8", reason="the float8 extra (torchao) is not installed")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "single_device_throughput.py"


def test_dry_run_prints_every_arm_and_ratio():
    env = {**os.environ, BACKEND_ENV: "aot_eager", "PYTHONPATH": str(SCRIPT.parents[1]), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--steps", "4", "--seq-len", "32",
                          "--compile", "--float8"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for arm in ("eager", "compile", "float8"):
        assert any(line.split()[:1] == [arm] and "tokens/s" in line for line in lines), run.stdout
    assert any(line.startswith("compile / eager") and "(torchtitan: 1.16x)" in line for line in lines), run.stdout
    assert any(line.startswith("float8 / compile") and "1.28x" in line and "not a speed measurement" in line
               for line in lines), run.stdout
    assert "this is not faster than bf16" in run.stderr  # the trainer's note for float8 on CPU


def test_float8_refused_on_gpu_without_float8_matmuls(monkeypatch):
    spec = importlib.util.spec_from_file_location("single_device_throughput", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(script.torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(script.torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SystemExit, match=r"needs float8 matmuls \(compute capability >= 8.9\); NVIDIA A100-SXM4-80GB has 8.0"):
        script.refuse_float8_speed_without_float8_matmuls()
