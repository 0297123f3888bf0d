"""bf16 mixed precision in every layout: 16-bit compute weights, fp32 master weights and moments.

`--dtype bf16` (plan key `param_dtype=bf16`, its default) computes with bf16 copies of the
weights while the model's registered parameters stay fp32: they are the master weights that
AdamW updates, with fp32 moments and fp32 gradients, and what checkpoints hold, so resuming,
`phalanx export` and `phalanx generate` read fp32 weights as before. Because the forward sees
bf16 weights and no autocast runs, every activation is bf16 from the embedding on: the residual
stream, and the input each linear saves for backward (the norm's output itself, shared by q, k
and v, not one cast copy per linear as autocast over fp32 weights saves).

Who makes the bf16 copies:
  - FSDP2, where it runs data parallelism (`data_parallel.uses_fsdp`: zero 2 and 3, and
    replicated dp beside tp or pp): its `MixedPrecisionPolicy(param_dtype=bf16)` gathers the
    shards into bf16 weights (`data_parallel.fsdp_options`), the gradients reduced into the fp32
    shards in `reduce_dtype`;
  - elsewhere (one process, DDP, tp or pp without dp) `apply_compute_weights` below: a forward
    pre-hook on every module that holds parameters puts a bf16 copy of each (`Tensor.to`,
    differentiable: its gradient arrives at the fp32 master in fp32) in the module's place for
    the duration of its forward, and a forward hook puts the master back.

Ideas weighed for the second case:
  - DDP's `mixed_precision=_MixedPrecision(...)` (private, experimental): DDP only, so one
    process, tp and pp would still need another mechanism; it swaps `param.data` and keeps the
    gradients in bf16 until its own reduction, and the experts that DDP must ignore under ep
    would not be cast at all. Not used.
  - `fully_shard` with a MixedPrecisionPolicy on a mesh where sharding is trivial: needs a
    process group and a DeviceMesh, which a one-process run does not have; it would replace DDP's
    bucketed all-reduce by per-block FSDP collectives for pure data parallelism, and make every
    parameter a DTensor. Not used (it is what runs already where FSDP runs anyway).
  - A pre-forward cast of the fp32 parameters to bf16 copies whose gradients flow back to the
    masters: public APIs, one mechanism for every remaining layout, parameters untouched (DDP's
    reducer, DTensor parameters under tp, pipeline stages, ep shards, expert slots, checkpoints
    and the optimizer see the same fp32 tensors as in an fp32 run). Chosen, per module rather
    than per block so that hooks a module already has (the ep gradient hook that attaches to a
    module's weights in its own pre-forward) still see the masters: hooks run in the order they
    were registered, and these are registered after expert parallelism's.

The copies are kept from the first forward that makes them until the optimizer steps: micro-
batches, pipeline micro-batches in flight and recomputation (checkpointed blocks) all use the
same copy, so a step holds one bf16 copy of the weights (as Megatron's bf16 model weights beside
its fp32 optimizer masters), never one per micro-batch. They are dropped by an optimizer step
pre-hook (`release_before_step`), so AdamW's own temporaries do not sit beside them, and a copy
whose master changed in place since (its version counter) is never reused. A copy made without
autograd (evaluation, sampling) is never used where a gradient must reach the master. Inside
a `torch.compile`d region the cast is traced into the graph on every call instead, without the
cache (whose tensors, kept across calls, would make dynamo guard on each and recompile):
tests/test_mixed_precision.py counts one frame and no graph break for a compiled block.

Private PyTorch API used: `nn.Module._parameters` (the dict `Module.__getattr__` reads a
parameter from; assigning a plain tensor there is how `torch.func.functional_call` swaps
parameters too) and `Tensor._version` (the in-place version counter autograd checks saved
tensors with). Both predate torch 2.0 (they are in its 2.0.1 source) and are unchanged in the
2.13 installed here; the public `register_forward_hook(always_call=...)` (torch 2.1) and
`Optimizer.register_step_pre_hook` (2.0) are older than 2.11 too. The v2.11.0 tree itself could
not be read here (the pytorch repository is larger than the fetch limit), so the GPU machines'
2.11 has not been checked by running.

What stays fp32 because the model needs it: RMSNorm's statistics (torch's `rms_norm` upcasts a
16-bit input: the mean of squares, its reciprocal square root and the normalization run in
fp32, the result is rounded once to bf16), the rotary rotation (`apply_rotary` computes in fp32
from the fp32 table; FSDP2's `cast_forward_inputs` is off so the table reaches the blocks in
fp32 there too), the router's scores, top-k and combine weights (`Router.forward` upcasts the
gate's logits; the aux and z losses read them), the loss (`token_loss` upcasts the logits), and
the gradients, their norm and AdamW's arithmetic on the fp32 masters.

`param_dtype=fp32` with `--dtype bf16` keeps the older mode, autocast over fp32 weights
(`autocast_for`): the residual stream and norms stay fp32 and every linear saves its own bf16
copy of its input, about twice the activation memory. A user would want it to rule bf16
rounding of the residual stream out as the cause of a divergence, or to fine-tune from an
fp32 checkpoint whose small residual updates bf16 would round away.

Private PyTorch APIs: this module uses none (hooks and `Tensor.to` are public). Elsewhere in
parallel/: `torch._foreach_norm` and `torch._foreach_mul_` (grad_norm.py),
`torch._C._autograd._top_saved_tensors_default_hooks` (sequence_parallel.py),
`torch.distributed._functional_collectives.AsyncCollectiveTensor` (compile.py,
sequence_parallel.py), `torch.distributed.algorithms._checkpoint.checkpoint_wrapper`
(recompute.py), `torch.distributed.tensor.placement_types._StridedShard` (materialize.py).
tests/test_private_torch_apis.py checks that each exists in the installed torch (2.13 here);
whether they exist in torch 2.11 could not be checked against its source (the code index at
hand holds an older pytorch/pytorch, version.txt 2.0.1, and the repository is too large to
fetch here): that test, run by CI on torch 2.11, is the check.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from phalanx.parallel.data_parallel import TORCH_DTYPES
from phalanx.plan import Plan


def mixed_precision(plan: Plan) -> bool:
    """Whether the forward computes with 16-bit copies of fp32 master weights."""
    return plan.param_dtype == "bf16"


def autocast_for(plan: Plan, dtype: str, device: torch.device):
    """The context a forward pass runs in: bf16 autocast only for the older mode (`--dtype bf16`
    with `param_dtype=fp32`: fp32 weights, each op cast); nothing in fp32 or mixed precision,
    where the weights the forward sees are already bf16."""
    if dtype == "bf16" and not mixed_precision(plan):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


class ComputeWeights:
    """The `dtype` compute copies of one model's fp32 masters, shared by the modules that hold
    the same master (a tied embedding and output projection keep one copy)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        """id(master) -> (master, its version when copied, copy); the master kept in the entry
        keeps its id from being reused, and the entries go at every optimizer step."""

    def copy_of(self, master: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Traced by torch.compile (a compiled block): cast inside the graph, no cache, whose
            # tensors kept across calls would make dynamo guard on and recompile per parameter.
            return master.to(self.dtype)
        entry = self.copies.get(id(master))
        needs_graph = torch.is_grad_enabled() and master.requires_grad
        if (entry is not None and entry[0] is master and entry[1] == master._version
                and (entry[2].requires_grad or not needs_graph)):
            return entry[2]
        copy = master.to(self.dtype)
        self.copies[id(master)] = (master, master._version, copy)
        return copy

    def hooks(self):
        """A forward pre-hook and a forward hook for one module: its parameters as copies during
        its forward, the masters back after it (also when the forward raised)."""
        masters: dict[str, torch.Tensor] = {}

        def before(module: nn.Module, args) -> None:
            for name, master in list(module._parameters.items()):
                if master is not None:
                    masters[name] = master
                    module._parameters[name] = self.copy_of(master)

        def after(module: nn.Module, args, output) -> None:
            module._parameters.update(masters)
            masters.clear()

        return before, after


_WEIGHTS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""module -> the `ComputeWeights` its hooks use, so that `release_before_step` finds them."""


def apply_compute_weights(model: nn.Module, dtype: str = "bf16") -> nn.Module:
    """Give every module of `model` that holds parameters `dtype` compute copies (the layouts
    where FSDP2 does not cast: one process, DDP, tp or pp without dp). On the meta model, before
    recompute wraps the blocks (the hooks then run inside the checkpointed region) and after
    expert parallelism (whose pre-forward hooks must see the masters)."""
    weights = ComputeWeights(TORCH_DTYPES[dtype])
    for module in model.modules():
        if module._parameters and module not in _WEIGHTS:
            before, after = weights.hooks()
            module.register_forward_pre_hook(before)
            module.register_forward_hook(after, always_call=True)
            _WEIGHTS[module] = weights
    return model


def drop_copies(model: nn.Module) -> None:
    """Forget the compute copies of `model`'s masters (the next forward makes them again)."""
    for weights in {id(w): w for m in model.modules() if (w := _WEIGHTS.get(m)) is not None}.values():
        weights.copies.clear()


def release_before_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Drop the step's compute copies when the optimizer steps: the masters change, and the
    copies would otherwise sit beside AdamW's temporaries until the next forward."""
    if any(module in _WEIGHTS for module in model.modules()):
        optimizer.register_step_pre_hook(lambda *_: drop_copies(model))
