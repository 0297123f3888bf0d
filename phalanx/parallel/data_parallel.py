"""Data parallelism: replicated (DDP) or sharded (FSDP2 `fully_shard`).

FSDP is applied on the meta device, before weights exist, so that no rank ever allocates the
full model; DDP needs real weights and is applied after materialization.
"""

from __future__ import annotations

from torch import nn

from phalanx.parallel.mesh import ParallelMesh


def apply_fsdp(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    """Shard each transformer block, then the rest (embedding, norm, output) at the root.

    Per-block units let FSDP gather one block's weights at a time and free them after use;
    resharding after forward trades an extra all-gather in backward for memory.
    """
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh.axis("dp")
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def apply_ddp(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=mesh.group("dp"))


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduction on all but the last micro-batch of an accumulated step."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    elif hasattr(model, "require_backward_grad_sync"):  # DDP
        model.require_backward_grad_sync = enabled
