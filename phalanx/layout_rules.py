"""The rules of a parallel layout, in one torch-free place.

Each function answers one question about a layout against a model's shape and returns the
reason it fails ("" when it does not), so that the planner's search, its `--fix` messages and
(later) `parallel/` and the launcher say the same thing in the same words. Shapes are passed
as plain integers: importing this needs neither torch nor the model code.
"""

from __future__ import annotations

import math

V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that place two chunks per rank in a V (the last stage's chunk on the first rank)."""


def tp_problem(tp: int, *, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int,
               expert_ffn_dim: int = 0, n_experts: int = 0, padded: bool = False) -> str:
    """Why tensor parallelism of degree `tp` cannot split this shape.

    tp splits the attention heads, the feed-forward (and each expert's) hidden size and, in
    the phalanx trainer, the KV heads and the vocabulary evenly. `padded`: an implementation
    that replicates KV heads when tp exceeds them, and pads the vocabulary (Megatron), needs
    only that tp is a multiple of n_kv_heads or divides them, and nothing of the vocabulary.
    """
    if tp < 1:
        return f"tp={tp} must be at least 1"
    if tp == 1:
        return ""
    if n_heads % tp:
        return f"tp={tp} does not divide n_heads={n_heads}"
    if padded:
        if n_kv_heads % tp and tp % n_kv_heads:
            return f"tp={tp} neither divides nor is a multiple of n_kv_heads={n_kv_heads}"
    elif n_kv_heads % tp:
        return f"tp={tp} does not divide n_kv_heads={n_kv_heads}"
    if ffn_dim % tp:
        return f"tp={tp} does not divide ffn_dim={ffn_dim}"
    if n_experts and expert_ffn_dim % tp:
        return f"tp={tp} does not divide the experts' ffn_dim={expert_ffn_dim}"
    if not padded and vocab_size % tp:
        return f"tp={tp} does not divide vocab_size={vocab_size}"
    return ""


def ep_problem(ep: int, *, dp: int, n_experts: int) -> str:
    """Expert parallelism spreads whole experts over data-parallel ranks."""
    if ep == 1:
        return ""
    if not n_experts or n_experts % ep:
        return f"ep={ep} must divide n_experts={n_experts}"
    if dp % ep:
        return f"ep={ep} must divide dp={dp} (experts are spread over data-parallel ranks)"
    return ""


def chunks_per_rank(schedule: str, pp: int, virtual: int) -> int:
    """Model chunks one pipeline rank holds: 1 (gpipe, 1f1b), `virtual` (interleaved), 2 (V)."""
    if pp == 1:
        return 1
    if schedule in V_SCHEDULES:
        return 2
    return virtual if schedule == "interleaved" else 1


def stages_of_rank(schedule: str, rank: int, pp: int, virtual: int) -> list[int]:
    """Virtual stages (model chunks in order) that pipeline rank `rank` holds.

    Looped placement (interleaved): rank r holds r, r + pp, r + 2 pp, ...; V placement (zbv,
    dualpipev): rank r holds r and 2 pp - 1 - r, so the first rank holds the last stage too.
    """
    if schedule in V_SCHEDULES and pp > 1:
        return [rank, 2 * pp - 1 - rank]
    return [rank + c * pp for c in range(chunks_per_rank(schedule, pp, virtual))]


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches a schedule runs: every stage busy once (pp), DualPipe two per
    stage (its two directions), gpipe any number."""
    if pp == 1 or schedule == "gpipe":
        return 1
    return 2 * pp if schedule == "dualpipev" else pp


def interleaved_rounds_problem(microbatches: int, pp: int) -> str:
    """Interleaved 1F1B runs micro-batches in rounds of about pp; the rounds must split them evenly."""
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        return f"microbatches={microbatches} do not split into {rounds} even rounds of about pp={pp}"
    return ""


def pipeline_problem(schedule: str, *, pp: int, virtual: int, microbatches: int, n_layers: int) -> str:
    """Why a pipeline schedule cannot run this many micro-batches over this many layers."""
    if pp == 1:
        return ""
    chunks = pp * chunks_per_rank(schedule, pp, virtual)
    if chunks > n_layers:
        return f"pp={pp} x {chunks // pp} chunks per rank = {chunks} stages exceeds n_layers={n_layers}"
    need = min_microbatches(schedule, pp)
    if microbatches < need:
        return f"schedule={schedule} with pp={pp} needs microbatches >= {need}, got {microbatches}"
    if schedule == "interleaved":
        return interleaved_rounds_problem(microbatches, pp)
    return ""


def layers_per_rank(n_layers: int, pp: int, chunks: int) -> int:
    """Layers on the most loaded pipeline rank (chunks of ceil(L / (pp * chunks)) layers)."""
    return chunks * math.ceil(n_layers / (pp * chunks))
