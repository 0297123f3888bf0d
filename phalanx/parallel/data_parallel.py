"""Data parallelism: replicated (DDP) or sharded (FSDP2 `fully_shard`).

FSDP is applied on the meta device, before weights exist, so that no rank ever allocates the
full model; DDP needs real weights and is applied after materialization.
"""

from __future__ import annotations

from torch import nn

from phalanx.parallel.mesh import ParallelMesh


def uses_fsdp(plan) -> bool:
    """FSDP2 runs data parallelism when asked (fsdp=true, HSDP), and also for replicated data
    parallelism composed with tp or pp: as HSDP with shard size 1 it all-reduces gradients like
    DDP, but it accepts DTensor parameters and pipeline stages, which DDP does not."""
    return plan.dp > 1 and (plan.fsdp or plan.tp > 1 or plan.pp > 1)


def apply_fsdp(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    """Shard each transformer block, then the rest (embedding, norm, output) at the root.

    Per-block units let FSDP gather one block's weights at a time and free them after use;
    resharding after forward trades an extra all-gather in backward for memory. Under pipeline
    parallelism every micro-batch would pay that all-gather again, so weights stay gathered
    between forward and backward there. `model` may be a pipeline chunk (some parts deleted).
    """
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh.fsdp_mesh()
    reshard = mesh.plan.pp == 1
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
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
