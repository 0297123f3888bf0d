"""Decode attention read straight from the paged pool: each sequence's one query against its
own keys and values, with every key and value row read once, where it lies in the pool.

The plain way (`paged_attention.py`'s fallback) gathers a group's key and value rows into a
padded tensor, then `scaled_dot_product_attention` reads them again: the rows cross memory
three times (read, write, read). A decode step is mostly memory traffic (one query row per
sequence against a few hundred keys), so on the CPU the products below, written as sums that
`torch.compile` (inductor) fuses with the row gather into loops over the pool, cost about a
third: `benchmarks/serve_step_ab.py --variant decode-attention`.

Compiled once per process, for any number of sequences and keys (dynamic shapes; a group of
one sequence is a second graph), by `warm_up` while the engine is built, so that no request
waits for it: about 3-9 s on the 2-core VM of 2026-12-02 (less once inductor's on-disk cache
holds it). Used on the CPU only: on CUDA the gather and
the flash kernel are the tested path. If compiling fails (no C++ compiler, say), a warning
says so once and the plain way is used from then on. `PHALANX_COMPILED_DECODE=0` turns it off.
"""

from __future__ import annotations

import os
import sys

import torch

ON = os.environ.get("PHALANX_COMPILED_DECODE", "1") != "0"
"""Whether CPU decodes read the pool through the compiled kernel (benchmarks switch it)."""
_compiled = None
_failed = False


def attend_from_pool(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                     visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, kv_heads, group, head_dim): each sequence's query heads folded under their kv
    head; k_pool (pool slots, kv_heads, head_dim) and v_pool (pool slots, kv_heads, channels):
    views of the layer's pool; slots (n, keys): each sequence's slots, padded with any slot;
    visible (n, keys) bool: its own keys (within the window) -> (n, kv_heads, group, channels).
    In float32 whatever the pool's dtype, as the flash kernel accumulates."""
    keys = k_pool[slots].float()  # (n, keys, kv_heads, head_dim): read inside the sum below when compiled
    scores = (q.float()[:, None] * keys[:, :, :, None, :]).sum(-1) * scale  # (n, keys, kv_heads, group)
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=1)
    values = v_pool[slots].float()  # (n, keys, kv_heads, channels)
    return (weights[..., None] * values[:, :, :, None, :]).sum(1).to(q.dtype)  # (n, kv_heads, group, channels)


def enabled(device: torch.device) -> bool:
    """Whether decodes on this device read the pool through the compiled kernel."""
    return ON and device.type == "cpu" and not _failed


def warm_up(model: torch.nn.Module, device: torch.device) -> None:
    """Compile for this model's attention shapes (this rank's heads under tensor parallelism):
    groups of one sequence and of several."""
    attention = next((block.attention for block in getattr(model, "layers", {}).values()
                      if hasattr(getattr(block, "attention", None), "wk")), None)  # latent attention has none
    if attention is None or not enabled(device):
        return
    head_dim = attention.head_dim
    local = [getattr(w, "_local_tensor", w) for w in (attention.wq.weight, attention.wk.weight)]
    heads, kv_heads = (w.shape[0] // head_dim for w in local)
    # Sizes unlike each other and the model's: dynamo guards on sizes that were equal when it
    # traced (duck sizing), and would compile again at the first step where they differ.
    taken = {1, heads, kv_heads, heads // kv_heads, head_dim, 2 * kv_heads * head_dim}
    several, keys, slots = [size for size in range(11, 1000) if size not in taken][:3]
    pool = torch.zeros(slots, 2 * kv_heads * head_dim, dtype=local[1].dtype, device=device)
    k_pool = pool[:, :kv_heads * head_dim].unflatten(-1, (kv_heads, head_dim))
    v_pool = pool[:, kv_heads * head_dim:].unflatten(-1, (kv_heads, head_dim))
    for n in (1, several):
        q = torch.zeros(n, kv_heads, heads // kv_heads, head_dim, dtype=pool.dtype, device=device)
        chosen = torch.zeros(n, keys, dtype=torch.long, device=device)
        with torch.no_grad():
            compiled_attend(q, k_pool, v_pool, chosen, torch.ones(n, keys, dtype=torch.bool, device=device),
                            head_dim ** -0.5)


def failed() -> bool:
    """Whether compiling was tried and failed (decodes gather from then on)."""
    return _failed


def compiled_attend(*args) -> torch.Tensor | None:
    """`attend_from_pool` compiled; None once compiling has failed (the caller then gathers)."""
    global _compiled, _failed
    if _failed:
        return None
    if _compiled is None:
        _compiled = torch.compile(attend_from_pool, dynamic=True, fullgraph=True)
    try:
        return _compiled(*args)
    except Exception as error:  # inductor needs a working C++ toolchain; serving must go on without it
        _failed = True
        print(f"phalanx: compiling decode attention failed ({type(error).__name__}: {error}); "
              "decoding gathers keys instead (slower)", file=sys.stderr, flush=True)
        return None
