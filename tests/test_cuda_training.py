"""The trainer on a GPU: bf16 on CUDA against fp32 on the CPU, a checkpoint saved in the
background on CUDA and loaded on the CPU, and `--compile` against eager, all through
`phalanx.train.loop.train` as `phalanx train` runs it (one process, no process group).

Bounds: bf16 against fp32 within phalanx/testing/bf16_bounds.py (losses BF16_LOSS, the first
gradient norm BF16_FIRST_GRAD_NORM, later ones BF16_GRAD_NORM, weights by their mean absolute
difference BF16_WEIGHT_MEAN: the same reasons hold across devices, where only the rounding
differs). A checkpoint is bytes: equal. Compiled against eager, both fp32 on the GPU: the
compiler fuses element-wise work and may sum in another order, ~1e-6 relative per step, so
losses within 1e-4 relative (the project's fp32 bound) and gradient norms within 1e-3.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from phalanx.model.by_name import model_config
from phalanx.testing.bf16_bounds import BF16_LOSS, BF16_WEIGHT_MEAN, bf16_grad_norm_bound
from phalanx.train.config import TrainConfig
from phalanx.train.loop import train
from phalanx.train.metrics import read_metrics
from tests.cuda_reference import CUDA_ONLY, full_weights

pytestmark = CUDA_ONLY


def _run(cfg: TrainConfig, name: str):
    """Train `cfg` into its own run directory; (TrainResult, gradient norm of each step)."""
    cfg = cfg.replace(out=f"{cfg.out}-{name}")
    result = train(cfg, Path(cfg.out))
    return result, [row["grad_norm"] for row in read_metrics(Path(cfg.out) / "metrics.jsonl")]


def test_bf16_on_cuda_is_within_the_bf16_bounds_of_fp32_on_cpu(tiny_config):
    ref, ref_norms = _run(tiny_config, "cpu-fp32")
    torch.cuda.reset_peak_memory_stats()
    got, norms = _run(tiny_config.replace(device="cuda", dtype="bf16"), "cuda-bf16")
    assert torch.cuda.max_memory_allocated() > 0  # this run's model really ran on the GPU
    assert next(got.model.parameters()).device.type == "cuda"
    assert len(got.losses) == len(ref.losses) == tiny_config.steps
    assert max(abs(a - b) for a, b in zip(got.losses, ref.losses)) < BF16_LOSS, (got.losses, ref.losses)
    for step, (norm, expected) in enumerate(zip(norms, ref_norms), 1):
        assert abs(norm - expected) < bf16_grad_norm_bound(step) * expected, (step, norm, expected)
    weights, ref_weights = full_weights(got.model), full_weights(ref.model)
    assert weights.keys() == ref_weights.keys()
    diff = sum(float((w - ref_weights[k]).abs().sum()) for k, w in weights.items())
    assert diff / sum(w.numel() for w in weights.values()) < BF16_WEIGHT_MEAN


def test_background_checkpoint_on_cuda_loads_on_cpu_equal(tiny_config):
    """`phalanx train` saves in the background by default (DCP async_save: the state is
    copied to host memory, then written by a thread); loaded into a CPU model drawn from
    another seed, every weight is the trained GPU model's."""
    from phalanx.model.init import build_model
    from phalanx.parallel.materialize import materialize
    from phalanx.checkpoint.store import latest_checkpoint, load_checkpoint
    from phalanx.train.loop import make_optimizer

    cfg = tiny_config.replace(device="cuda", steps=2, ckpt_every=2)
    trained, _ = _run(cfg, "ckpt")
    found = latest_checkpoint(Path(f"{cfg.out}-ckpt"))
    assert found is not None and found[0] == 2
    model_cfg = model_config(cfg.model)
    model = materialize(build_model(model_cfg), model_cfg, 7, "cpu")
    optimizer = make_optimizer(model, cfg)
    assert load_checkpoint(found[1], model, optimizer) == 2
    expected = full_weights(trained.model)
    loaded = full_weights(model)
    assert loaded.keys() == expected.keys()
    for name, value in loaded.items():
        assert torch.equal(value, expected[name]), name
    assert all(state["exp_avg"].device.type == "cpu" for state in optimizer.state.values())


def test_pinned_host_staging_of_a_cuda_state_saves_and_loads_equal(tmp_path):
    """DCP's stager with pinned host copies (the fast path for device-to-host copies): every
    staged tensor is pinned and equal, and the background save loads back equal on the CPU."""
    staging = pytest.importorskip("torch.distributed.checkpoint.staging")
    if not hasattr(staging, "DefaultStager"):
        pytest.skip("this torch has no DefaultStager")
    import inspect

    import torch.distributed.checkpoint as dcp

    if "async_stager" not in inspect.signature(dcp.async_save).parameters:
        pytest.skip("this torch's dcp.async_save takes no async_stager")
    state = {"w": torch.randn(64, 32, device="cuda"), "b": torch.randn(32, device="cuda")}
    stager = staging.DefaultStager(staging.StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                          use_async_staging=False, use_non_blocking_copy=False))
    try:
        staged = stager.stage(state)
        assert all(v.device.type == "cpu" and v.is_pinned() and torch.equal(v, state[k].cpu()) for k, v in staged.items())
        dcp.async_save(state, checkpoint_id=str(tmp_path / "ckpt"), async_stager=stager).result()
    finally:
        stager.close()
    loaded = {k: torch.zeros(v.shape) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))
    assert all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())


def test_compile_on_cuda_equals_eager(tiny_config):
    if "compile" not in {f.name for f in dataclasses.fields(TrainConfig)}:
        pytest.skip("--compile is not in this build (phalanx train has no compile setting)")
    cfg = tiny_config.replace(device="cuda", steps=3)
    eager, eager_norms = _run(cfg, "eager")
    compiled, norms = _run(cfg.replace(compile=True), "compiled")
    for a, b in zip(compiled.losses, eager.losses, strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (compiled.losses, eager.losses)
    for a, b in zip(norms, eager_norms, strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (norms, eager_norms)
