"""What the CUDA-marked tests (tests/test_cuda_*.py) share: the skip, a one-rank NCCL group, a
hand-built one-rank mesh, and a few optimizer steps whose losses, gradient norms and weights
are compared against a reference.

Every test here needs a CUDA device and is skipped without one, so `pytest -m cuda` on a CPU
machine collects them and skips them all; benchmarks/device_check.sh runs them on a GPU.
"""

from __future__ import annotations

import contextlib
import datetime

import pytest
import torch
import torch.distributed as dist

from phalanx.plan import Plan

CUDA_ONLY = [pytest.mark.cuda,
             pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
"""`pytestmark = CUDA_ONLY` in each CUDA test module."""

STEPS, BATCH, SEQ = 3, 4, 32


@contextlib.contextmanager
def nccl_group():
    """The default process group: one rank, NCCL for CUDA tensors and gloo for CPU ones (DCP's
    background save refuses a group without a CPU backend)."""
    from phalanx.ports import free_port

    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def one_rank_mesh(plan: Plan, device: torch.device):
    """A ParallelMesh over the one-rank group for `plan`, built by hand: `build_mesh` would
    validate the plan, and a plan that only makes sense on several ranks (FSDP or offload at
    dp=1) is what these tests need to put NCCL and FSDP2 under the trainer's code on one GPU."""
    from torch.distributed.device_mesh import init_device_mesh

    from phalanx.parallel.mesh import ParallelMesh

    device_mesh = init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    return ParallelMesh(plan=plan, device=device, world_size=1, rank=0, device_mesh=device_mesh)


def batches(vocab: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)  # (batch, seq + 1)
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return out


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter whole, fp32 on the CPU, under the model's own names."""
    from torch.distributed.tensor import DTensor

    from phalanx.model.init import canonical_name

    def whole(param: torch.Tensor) -> torch.Tensor:
        param = param.detach()
        if not isinstance(param, DTensor):
            return param
        if param.device.type != param.device_mesh.device_type:  # offloaded shards: gather on the mesh's device
            param = param.to(param.device_mesh.device_type)
        return param.full_tensor()

    return {canonical_name(name): whole(p).float().cpu() for name, p in model.named_parameters()}


def train_steps(model, vocab: int, device: torch.device, autocast=contextlib.nullcontext) -> dict:
    """STEPS AdamW steps as the trainer takes them (its loss, clipping at 1.0, no decay on
    vectors): {"losses", "grad_norms", "weights"}."""
    from phalanx.parallel.grad_norm import clip_grad_norm
    from phalanx.train.loop import batch_loss

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    losses, norms = [], []
    for inputs, targets in batches(vocab, device):
        loss = batch_loss(model, inputs, targets, autocast)
        loss.backward()
        norms.append(clip_grad_norm(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norms": norms, "weights": full_weights(model)}


def assert_same_run(got: dict, ref: dict, tolerance: float) -> None:
    """Losses and gradient norms within `tolerance` relative, every weight within it absolute."""
    for key in ("losses", "grad_norms"):
        assert len(got[key]) == len(ref[key]) == STEPS
        for a, b in zip(got[key], ref[key]):
            assert abs(a - b) <= tolerance * abs(b), (key, got[key], ref[key])
    assert got["weights"].keys() == ref["weights"].keys()
    for name, value in got["weights"].items():
        torch.testing.assert_close(value, ref["weights"][name], atol=tolerance, rtol=0, msg=name)
