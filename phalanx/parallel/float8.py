"""`--float8`: torchao's float8 training of the transformer blocks' linear layers.

`torchao.float8.convert_to_float8_training` swaps each chosen `nn.Linear` for a
`Float8Linear`: forward and backward matmuls take float8 operands (e4m3 for weights and
activations, e5m2 for gradients) through `torch._scaled_mm`, with results, weights, gradients
and the optimizer in the usual precision. Not converted: the output layer (the vocabulary
projection, most sensitive to rounding, as torchtitan leaves it too), the embedding, MoE
routers and routed experts (stacked weights, not `nn.Linear`), and any linear whose in or out
features are not multiples of 16 (`_scaled_mm`'s requirement).

Scaling: tensorwise (torchao's default recipe): one scale per tensor, from its absolute
maximum, computed anew at every step (dynamic scaling). Chosen because it is the recipe
torchtitan's published figure (float8 1.28x over compile, Llama 3 8B on 8 H100s) was measured
with, and the fastest on H100s; rowwise scaling (one scale per row) rounds less but runs slower
and is not offered.

Where it sits in `parallel/apply.py`'s order: first after the pipeline split, on the plain
modules, before every wrapper and before compile (which then fuses the casts and scale
computations into the block's graph; float8 without compile pays them eagerly).

Speed needs a GPU with float8 matmuls (compute capability >= 8.9: Ada, Hopper, Blackwell).
Elsewhere: on CPU, torch 2.13's `_scaled_mm` runs float8 operands, so the numerics can be
checked (tests/test_float8.py) but nothing is faster, and the run says so; a CUDA device
without float8 matmuls is refused in one line. Not composed yet, and refused with the reason:
tensor parallelism (torchao's float8 tensor-parallel styles are not wired in) and MoE
models (their routed experts are stacked weights, not `nn.Linear`, and would stay in high
precision: dense models only). FSDP2's float8 all-gather (weights sent as float8) is not exposed: gloo has no float8
collectives, and it is only a speed option.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch
from torch import nn

from phalanx.errors import UserError

TORCHAO_PIN = "torchao>=0.17,<0.19"
"""What the `float8` extra installs: 0.17 and 0.18 are the releases built for torch >= 2.11
(earlier ones for one exact torch each); keep in step with pyproject.toml."""

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with float8 tensor-core matmuls (Ada, H100 is 9.0)."""


@contextlib.contextmanager
def _quiet_import():
    """torchao's import logs that its CUDA-only kernels do not load on a CPU-only torch, and
    torch logs a deprecation from torchao's pytree registration; neither concerns float8 training."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def torchao_float8():
    """torchao's float8 module, imported on first use (an optional extra)."""
    try:
        with _quiet_import():
            # Imported when run, not at the top: it brings in torchao, which start-up need not wait for.
            import torchao.float8 as float8
    except ImportError:
        raise UserError(f"--float8 needs torchao: pip install 'phalanx[float8]' ({TORCHAO_PIN})") from None
    return float8


def check_float8_device(device: torch.device) -> str:
    """A refusal for a CUDA device without float8 matmuls; else '' on such a GPU, or on CPU
    the note that float8 runs there for its numerics only."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise UserError(f"--float8 needs float8 matmuls (CUDA compute capability >= 8.9); "
                            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
        return ""
    return (f"--float8 on {device.type}: float8 matmuls are emulated for their numerics only; "
            "this is not faster than bf16 (speed needs a GPU with compute capability >= 8.9)")


def _converts(module: nn.Module, name: str) -> bool:
    """Which linears become float8: the blocks' dense ones with float8-friendly shapes."""
    if not isinstance(module, nn.Linear) or not name.startswith("layers."):
        return False
    if ".router" in name or ".experts" in name:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, enabled: bool) -> nn.Module:
    """Swap the chosen linears of `model` (a Transformer or pipeline chunk, on the meta device)
    for torchao's Float8Linear, tensorwise scaling; names and parameters stay the same."""
    if not enabled:
        return model
    float8 = torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name("tensorwise")
    return float8.convert_to_float8_training(model, config=config, module_filter_fn=_converts)


def note_float8_device(device: torch.device, enabled: bool, rank: int) -> None:
    """Refuse a GPU without float8 matmuls; elsewhere rank 0 says float8 is not faster here."""
    if enabled and (note := check_float8_device(device)) and rank == 0:
        print(f"phalanx: note: {note}", file=sys.stderr)
