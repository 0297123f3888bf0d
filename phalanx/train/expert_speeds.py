"""Each ep rank's speed, for the expert slots' placement (`--rebalance-every`, issue 40).

A rank's speed is the work it did over its compute time (the step's time less its measured
waits, phalanx/train/rank_clock.py). Under expert parallelism the work is not the same on every
rank: each computes the dense part of its own sequences (the same on every dp rank: equal
shares) plus the expert rows its slots received, which the placement itself decides. So:

    work_r = tokens x dense FLOPs per token + sum over MoE layers of rows_r x FLOPs per expert row

(forward and backward: 6 FLOPs per matrix parameter per token; an expert row is one token's
pass through one SwiGLU expert, 3 x dim x moe_ffn_dim parameters; the dense FLOPs per token are
`parallel/stage_split.unit_costs`' whole model less the routed experts' k rows per MoE layer.)
Counting rows rather than time keeps the measure from feeding on itself: a rank holding hot
experts takes longer because it computes more, not because it is slower.

An ep rank's slots are held by one rank in each expert-data-parallel group (ep ranks are
adjacent dp ranks, `ParallelMesh.split_dp`); the slowest of them sets its pace.

Only where the waits are measured: on gloo (CPU). With NCCL the dispatch's all-to-alls return
before the rows arrive, a fast rank's waits would count as its compute, and the speeds would
look equal or, worse, follow the load; there `measured_rank_speeds` gives None.
"""

from __future__ import annotations

from typing import Sequence

from phalanx.parallel.stage_split import unit_costs


def flops_per_token(model_cfg, seq_len: int) -> tuple[float, float]:
    """(dense FLOPs per token, FLOPs per routed expert row), forward and backward."""
    per_token = sum(unit_costs(model_cfg, seq_len, 1))  # every layer, the embedding and the output
    expert_row = 6.0 * 3 * model_cfg.dim * model_cfg.moe_ffn_dim
    moe_layers = sum(model_cfg.is_moe_layer(layer) for layer in range(model_cfg.n_layers))
    return per_token - moe_layers * model_cfg.experts_per_token * expert_row, expert_row


def rank_speeds(compute_s: Sequence[float], rows: Sequence[float], *, tokens: float, dense: float,
                expert_row: float) -> list[float] | None:
    """FLOPs per second of each rank: (tokens x dense + rows_r x expert_row) / compute_s[r];
    `rows[r]`: the expert rows rank r's slots computed this step, over every MoE layer. None
    when a rank has no measurement."""
    if any(c <= 0 for c in compute_s):
        return None
    return [(tokens * dense + n * expert_row) / c for n, c in zip(rows, compute_s)]


def ep_speeds(speeds: Sequence[float], ep: int) -> list[float]:
    """Each ep rank's speed: the slowest of the ranks holding its slots (rank r is ep rank r % ep)."""
    return [min(speeds[r] for r in range(e, len(speeds), ep)) for e in range(ep)]


def measured_rank_speeds(moe_record: dict, compute_s: Sequence[float] | None, *, model_cfg, seq_len: int,
                         tokens: float, cuda: bool) -> list[float] | None:
    """The step's per-rank speeds from its `moe` record (`rank_tokens` per dp rank and MoE
    layer) and every rank's compute seconds; None on CUDA (see the module docstring) or
    without the figures."""
    if cuda or not moe_record or compute_s is None:
        return None
    rows = [0.0] * len(compute_s)
    for layer in moe_record.values():
        if len(layer["rank_tokens"]) != len(rows):  # ranks beyond dp (tp, pp): slots refuse them
            return None
        rows = [r + n for r, n in zip(rows, layer["rank_tokens"])]
    dense, expert_row = flops_per_token(model_cfg, seq_len)
    return rank_speeds(compute_s, rows, tokens=tokens, dense=dense, expert_row=expert_row)
