"""Data parallelism: replicated (DDP) or sharded (FSDP2 `fully_shard`), in the plan's precision.

Precision: where FSDP2 runs, its `MixedPrecisionPolicy` gathers the weights in param_dtype and
reduces gradients in reduce_dtype into the fp32 shards; under DDP the model's own bf16 compute
copies (`mixed_precision.py`) feed the forward, and reduce_dtype=bf16 compresses the fp32
gradients for the all-reduce (`bf16_compress_hook`).

FSDP is applied on the meta device, before weights exist, so that no rank ever allocates the
full model; DDP needs real weights and is applied after materialization.

The zero level (`Plan.zero`) maps onto FSDP2 as follows:
  zero=3  `reshard_after_forward=True`: parameters sharded, gathered per unit in forward and
          again in backward (units below the block: `apply_fsdp`);
  zero=2  `reshard_after_forward=False`: gathered in forward and kept until the block's backward;
          gradients and optimizer state stay sharded;
  zero=0  DDP (pure data parallelism), or FSDP2 as HSDP with shard size 1 under tp or pp.
Under pp the weights stay gathered between forward and backward whatever the level: every
micro-batch would pay the all-gather again, and the zero-bubble schedules look for the weights of
their separate weight-gradient pass among the module's registered parameters.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from phalanx import layout_rules as rules
from phalanx.model.feed_forward import FeedForward
from phalanx.parallel.mesh import ParallelMesh
from phalanx.plan import Plan

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def uses_fsdp(plan: Plan) -> bool:
    """FSDP2 runs data parallelism when asked (zero 2 or 3, HSDP), and also for replicated data
    parallelism composed with tp or pp: as HSDP with shard size 1 it all-reduces gradients like
    DDP, but it accepts DTensor parameters and pipeline stages, which DDP does not
    (the rule's home: `layout_rules.runs_fsdp`, which the planner reads too)."""
    return rules.runs_fsdp(plan.dp, zero=plan.zero, tp=plan.tp, pp=plan.pp)


def fsdp_options(plan: Plan, device: torch.device) -> dict:
    """Keyword arguments for every `fully_shard` call of this plan (blocks, root, experts)."""
    # cast_forward_inputs off: the blocks' hidden states are bf16 already (the embedding's weights
    # are), and the rotary table they also receive stays fp32, as where no FSDP runs.
    mixed = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[plan.param_dtype or "fp32"], reduce_dtype=TORCH_DTYPES[plan.reduce_dtype or "fp32"],
        cast_forward_inputs=False,
    )
    # Pinned host memory speeds up copies to a GPU; without one there is nothing to pin for.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if plan.offload else OffloadPolicy()
    return {"reshard_after_forward": plan.zero == 3 and plan.pp == 1, "mp_policy": mixed, "offload_policy": offload}


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, *, units_below_block: bool = True) -> nn.Module:
    """Shard each transformer block, then the rest (embedding, norm, output) at the root.

    Per-block units let FSDP gather one block's weights at a time; whether they are freed after
    forward follows the zero level (see the module docstring). `model` may be a pipeline chunk
    (some parts deleted). At zero=3 without pp, units go below the block too (`sub_block_units`):
    the attention, and each linear of a dense MLP, so FSDP gathers, prefetches and reduces
    a fraction of a block at a time (the 530B model's blocks hold 5 billion parameters each:
    gathered whole they alone need tens of GiB). `units_below_block=False` keeps one unit per
    block: `--compile` does (a unit inside a compiled block would have FSDP's hooks traced into
    its graph).
    """
    dp_mesh = mesh.fsdp_mesh()
    options = fsdp_options(mesh.plan, mesh.device)
    below = units_below_block and mesh.plan.zero == 3 and mesh.plan.pp == 1
    if below and any(type(module).__name__ == "Float8Linear" for module in model.modules()):
        quiet_float8_view_warnings()
    for block in model.layers.values():
        for unit in sub_block_units(block) if below else ():
            fully_shard(unit, mesh=dp_mesh, **options)
        fully_shard(block, mesh=dp_mesh, **options)
    fully_shard(model, mesh=dp_mesh, **options)
    return model


FLOAT8_VIEW_WARNING = r"FSDP2-wrapped module \((FSDPFloat8Linear|FSDPAttention)\) returned a view tensor"
"""torch 2.13's warning, once per unit class and process, when an FSDP unit's output is a view."""


def quiet_float8_view_warnings() -> None:
    """Silence FSDP2's "returned a view tensor" warning for the float8 units below the block.

    torchao's Float8Linear computes a 2-D matmul and reshapes it back to (batch, seq, out): a
    view. So each linear unit of a dense MLP, and the attention unit (its last op is `wo`), hands
    FSDP a view, and FSDP warns that an in-place op on it (`out += y`) would drop its pre-backward
    hook. Nothing here does one: the block adds both outputs out of place (`x + ...`), and the
    MLP feeds w1's and w3's to `silu` and `*` (model/transformer.py, model/feed_forward.py), so
    the hook fires and the gradients are those of one process (tests/test_float8.py compares
    dp=2,zero=3). A `.clone()` instead would copy every activation for nothing. Only these two
    unit classes, only with float8: a view from any other unit still warns."""
    warnings.filterwarnings("ignore", message=FLOAT8_VIEW_WARNING, category=UserWarning)


def sub_block_units(block: nn.Module) -> list[nn.Module]:
    """The FSDP units below a block: its attention, and each linear of a dense MLP (an MoE's
    experts are their own units already, parallel/expert.py; its router stays with the block).
    Found by name, so a block wrapped for recompute (`_checkpoint_wrapped_module.`) works too."""
    units = []
    for name, module in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "attention":
            units.append(module)
        elif leaf == "feed_forward" and isinstance(module, FeedForward):
            units += [linear for linear in (module.w1, module.w3, module.w2) if linear is not None]
    return units


def apply_ddp(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    """Replicated data parallelism; with reduce_dtype=bf16 gradients travel as bf16 (PyTorch's
    `bf16_compress_hook`: cast, all-reduce, divide, cast back into the fp32 gradient)."""
    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=mesh.group("dp"))
    if mesh.plan.reduce_dtype == "bf16":

        hook = bf16_compress_hook if mesh.device.type == "cuda" else _bf16_compress_hook_off_cuda
        ddp.register_comm_hook(mesh.group("dp"), hook)
    return ddp


def _bf16_compress_hook_off_cuda(state, bucket):
    """PyTorch's `bf16_compress_hook` under another name. DDP refuses that hook by name unless
    CUDA with NCCL >= 2.10 (the first NCCL with bf16 all-reduce) is present, but gloo all-reduces
    bf16 too, so the hook itself runs unchanged on CPU."""
    return bf16_compress_hook(state, bucket)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduction on all but the last micro-batch of an accumulated step."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    elif hasattr(model, "require_backward_grad_sync"):  # DDP
        model.require_backward_grad_sync = enabled
