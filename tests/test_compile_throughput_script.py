"""benchmarks/single_device_throughput.py, the GPU session's script, runs on CPU in its tiny size.

Its dry run trains every arm (eager, compiled, compiled float8) for 4 steps and prints each
arm's tokens/s and both ratios beside torchtitan's figures. The compiled arms use the
`aot_eager` backend here (tests/test_compile.py says why); the figures themselves are not
checked (no timing assertions), only that every arm ran and reported.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from phalanx.parallel.compile import BACKEND_ENV
from phalanx.testing.fork_ranks import run_ranks

pytest.importorskip("torchao.float8", reason="the float8 extra (torchao) is not installed")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "single_device_throughput.py"


def _run_script(argv: list[str]) -> tuple[str, str]:
    """The script's stdout and stderr, run as `python SCRIPT argv` in this (forked) process."""
    import contextlib
    import io
    import runpy

    out, err = io.StringIO(), io.StringIO()
    sys.argv = [str(SCRIPT), *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    return out.getvalue(), err.getvalue()


def test_dry_run_prints_every_arm_and_ratio(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")  # inherited by the forked rank
    # A forked rank: torch is imported once, and the compiled arms' dynamo state stays there.
    [(stdout, stderr)] = run_ranks(1, _run_script, ["--size", "tiny", "--steps", "4", "--seq-len", "32", "--compile",
                                                     "--float8"], timeout_s=600)
    lines = stdout.splitlines()
    for arm in ("eager", "compile", "float8"):
        assert any(line.split()[:1] == [arm] and "tokens/s" in line for line in lines), stdout
    assert any(line.startswith("compile / eager") and "(torchtitan: 1.16x)" in line for line in lines), stdout
    assert any(line.startswith("float8 / compile") and "1.28x" in line and "not a speed measurement" in line
               for line in lines), stdout
    assert "this is not faster than bf16" in stderr  # the trainer's note for float8 on CPU


def test_float8_refused_on_gpu_without_float8_matmuls(monkeypatch):
    spec = importlib.util.spec_from_file_location("single_device_throughput", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(script.torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(script.torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SystemExit, match=r"needs float8 matmuls \(compute capability >= 8.9\); NVIDIA A100-SXM4-80GB has 8.0"):
        script.refuse_float8_speed_without_float8_matmuls()
