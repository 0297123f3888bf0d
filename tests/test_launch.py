"""The launchers: `phalanx train --nproc N` (elastic, forked workers) and an external
`torchrun` give the same per-step losses as one process, and bf16 mixed precision trains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.cli import main
from phalanx.ports import free_port
from phalanx.testing.fork_ranks import run_ranks
from phalanx.train.loop import train
from phalanx.train.metrics import parse_lines, read_metrics
from phalanx.train.restarts import FAULT_ENV

ARGS = ["--model", "tiny", "--steps", "3", "--global-batch", "4", "--seq-len", "16", "--no-progress",
        "--sample-tokens", "0", "--eval-every", "0", "--device", "cpu"]


def _train_losses(cfg) -> list[float]:
    return train(cfg, Path(cfg.out)).losses


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl")]


def _phalanx(*argv: str) -> None:
    """`phalanx ...` in this process (its --nproc workers fork from it, as from the CLI's)."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 0


def test_nproc_and_torchrun_match_one_process(tmp_path, monkeypatch):
    """Same tolerance as tests/test_data_parallel.py (1e-4: float reassociation of the
    gradient all-reduce over 3 AdamW steps). The --nproc runs go through the CLI's main here,
    not a new interpreter (which would import torch again); torchrun needs its own.

    The torchrun run is a user's own `torchrun --max-restarts 1` whose rank 1 SIGKILLs itself
    after step 2 (the test hook, first attempt only): torchrun restarts the workers, which
    resume from step 2's checkpoint by themselves and end with one row per step."""
    python = sys.executable
    _phalanx("train", *ARGS, "--nproc", "1", "--out", str(tmp_path / "one"))
    _phalanx("train", *ARGS, "--nproc", "2", "--out", str(tmp_path / "two"))
    monkeypatch.setenv(FAULT_ENV, "1:2:SIGKILL")
    subprocess.run([python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "phalanx", "train",
                    *ARGS, "--plan", "dp=2,fsdp=true", "--ckpt-every", "1", "--sync-checkpoint",
                    "--out", str(tmp_path / "torchrun")], check=True, timeout=240, capture_output=True)
    reference = _losses(tmp_path / "one")
    assert len(reference) == 3
    for run in ("two", "torchrun"):
        assert max(abs(a - b) for a, b in zip(_losses(tmp_path / run), reference)) < 1e-4, run
    rows = parse_lines((tmp_path / "torchrun" / "metrics.jsonl").read_text())[0]
    assert [r["step"] for r in rows] == [1, 2, 2, 3], rows
    assert rows[2] == {"event": "restart", "step": 2, "restart": 1,
                       "reason": "torchrun restarted the workers after a failure"}, rows
    assert (tmp_path / "one" / "loss.png").stat().st_size > 1000


def test_bf16_trains_close_to_fp32(tiny_config):
    """bf16 keeps 8 mantissa bits (relative error ~4e-3 per op); the first-step loss of the
    same weights and batch agrees with fp32 to 2e-2, and training still lowers the loss."""
    fp32 = run_ranks(1, _train_losses, tiny_config)[0]
    bf16 = run_ranks(1, _train_losses, tiny_config.replace(dtype="bf16", out=tiny_config.out + "-bf16"))[0]
    assert abs(bf16[0] - fp32[0]) < 2e-2
    assert bf16[-1] < bf16[0] - 0.3


def test_plan_auto_picks_a_runnable_plan(tiny_config):
    """`--plan auto` asks the planner; what it returns must be a plan the trainer accepts on
    that many processes for this model and batch (validated as a hand-written plan would be),
    and the job records it as the run's plan, parsed once."""
    from phalanx.model.by_name import model_config
    from phalanx.plan_model_checks import validate_for_model
    from phalanx.plan import plan_from_string
    from phalanx.train.job import resolve_job

    for world in (1, 2, 4):
        said = []
        job = resolve_job(tiny_config.replace(plan="auto"), world, None, run_dir="unused", log=said.append)
        plan = plan_from_string(job.settings.plan, world)
        validate_for_model(plan, model_config("tiny"), global_batch=tiny_config.global_batch, seq_len=tiny_config.seq_len)
        assert job.plan.replace(param_dtype="", reduce_dtype="") == plan and job.plan_text == plan.to_string()
        assert said == [f"phalanx: --plan auto chose {plan} for {world} process{'es' if world > 1 else ''}"]


def test_two_launchers_form_one_group_with_nnodes(tmp_path):
    """`--nnodes 2` with one `--rdzv-endpoint`: two launchers (two "machines" on one host, each
    --nproc 2) form one 4-rank group (their workers forked from forkservers) and train as one
    process does, within the data-parallel tests' 1e-4."""
    _phalanx("train", *ARGS, "--nproc", "1", "--out", str(tmp_path / "one"))
    argv = [sys.executable, "-m", "phalanx", "train", *ARGS, "--nproc", "2", "--nnodes", "2", "--plan", "dp=4",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--out", str(tmp_path / "two-nodes")]
    launchers = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [launcher.communicate(timeout=120) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
    assert any("on 2 processes per node on 2 nodes" in err for _, err in outputs), outputs
    reference, losses = _losses(tmp_path / "one"), _losses(tmp_path / "two-nodes")
    assert len(losses) == len(reference) == 3
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-4
