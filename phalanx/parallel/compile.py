"""`--compile`: `torch.compile` each transformer block, as torchtitan does.

Why per block and not the whole model: the blocks are alike, so one compiled graph serves all
of them (dynamo treats a module's parameters as graph inputs, `inline_inbuilt_nn_modules`, and
does not compile again per layer), compile time does not grow with depth, and the wrappers
around the blocks stay outside the compiled code: FSDP2's per-block hooks (all-gather,
reduce-scatter) run eagerly around it (dynamo skips them, `skip_fsdp_hooks`), DDP's gradient
hooks fire on the compiled backward's gradients, and a pipeline schedule calls the stage as
always. Compiling an FSDP root instead captures nothing worth having: its forward is the
embedding, a loop over already-wrapped blocks and the output layer.

Where it sits in `parallel/apply.py`'s order: after tensor parallelism (the graph then holds
the DTensor ops and the sequence-parallel input hooks), after recompute (the graph holds the
checkpoint region, which dynamo traces with its selective policy), before FSDP (whose hooks
stay outside). With pipelines, once per chunk like the other steps.

Dense blocks compile with `fullgraph=True`: a graph break is an error, never a silent fall
back to eager. An MoE block's routed experts read counts to the host (`tolist()` for the
per-expert loop and for expert parallelism's all-to-all split sizes) and keep statistics on
the module, which dynamo cannot capture in one graph; so in an MoE block only its attention
is compiled (`fullgraph=True` too), and the router and experts run eagerly.

Under context parallelism each block's graph also holds the hook that hands attention its view
of the sequence and the key/value gather (a functional collective), as docs/layout.md says.

What `--compile` does not compose with is refused in `validate_compile` (one line, before any
worker starts), with the reason.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from phalanx.model.moe import MoE

BACKEND_ENV = "PHALANX_TEST_COMPILE_BACKEND"
"""Test hook: the torch.compile backend (default inductor). The multi-rank tests set
`aot_eager`: the same dynamo capture and AOT-autograd forward and backward graphs, without
inductor's code generation (tests/test_compile.py says why)."""


def _is_moe(block: nn.Module) -> bool:
    return any(isinstance(module, MoE) for module in block.modules())


def apply_compile(model: nn.Module, enabled: bool) -> nn.Module:
    """Compile each block of `model` (a Transformer or pipeline chunk) in place.

    `Module.compile` keeps the module object, so parameter names, checkpoints and the
    wrappers applied later see the same model as without `--compile`."""
    if not enabled:
        return model
    backend = os.environ.get(BACKEND_ENV, "inductor")
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_settled)
    for block in model.layers.values():
        if _is_moe(block):
            attention = next(module for name, module in block.named_modules() if name.endswith("attention"))
            attention.compile(fullgraph=True, backend=backend)
        else:
            block.compile(fullgraph=True, backend=backend)
    return model


def _settled(module: nn.Module, inputs, output):
    """The embedding's output as a plain tensor. Under tensor parallelism it is the result of
    an asynchronous all-reduce (or reduce-scatter), an `AsyncCollectiveTensor`; fed to the first
    compiled block as such, the gradient the block returns for it reaches the all-reduce's
    backward as a plain tensor where a DTensor is expected (AttributeError `_local_tensor`, torch
    2.13). A copy waits for the collective and hands the block an ordinary tensor; it costs one
    (batch, seq, dim) copy per forward."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else None


def uncompiled():
    """A context in which compiled blocks run their eager code: for generation, whose growing
    cache would compile the blocks again for every length (and break their graphs)."""
    return torch.compiler.set_stance("force_eager")
