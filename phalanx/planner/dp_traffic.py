"""Data-parallel traffic per step: what each ZeRO level's collectives cost, how much of it
compute hides, and the expert slots' replica gradient sum."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from phalanx import layout_rules as rules
from phalanx.planner import comm
from phalanx.planner.hardware import Cluster
from phalanx.planner.memo import collective_time
from phalanx.planner.layout import Layout
from phalanx.planner.options import Options
from phalanx.planner.peak_memory import BUCKET_BYTES, expert_shards, folds_experts, param_counts_of

from phalanx.planner.stage_time import StageTimes

if TYPE_CHECKING:
    from phalanx.model.config import ModelConfig


def dp_time(cluster: Cluster, lay: Layout, options: Options, shared: float, experts: float,
             st: StageTimes, n_layers: int, regathered: float = 0.0) -> float:
    """Exposed data-parallel seconds per step. `regathered`: the share of layers whose full
    recompute re-runs the forward under zero 3, gathering their parameters once more."""
    if lay.replicas == 1:  # dp x cp: the ranks whose gradients are summed
        return 0.0
    fw, queue = cluster.framework, cluster.queueing(lay.world_size)
    g = options.grad_reduce_bytes
    gathered = options.precision.gathered  # FSDP gathers in param_dtype: bf16, or fp32 in an fp32 run
    shard = lay.replicas // lay.replicate
    groups = [(shared, shard, lay.tp)]  # (params, group size, stride): dp x cp ranks sit tp apart
    if experts:
        # edp ranks: same place in each ep group, ep groups being adjacent dp ranks (tp * ep
        # ranks apart), or, folded, adjacent ranks of dp x tp (ep ranks apart).
        groups.append((experts, expert_shards(lay, shard), lay.ep if folds_experts(lay) else lay.tp * lay.ep))
    # Collectives are issued per FSDP unit (one per layer, plus the root) under zero 2 and 3
    # (FSDP2, with and without resharding after forward), and per gradient bucket otherwise,
    # so latency, which grows with dp in a ring, counts once per unit or bucket.
    units = n_layers + 1 if lay.zero == 3 else 0
    collectives = n_layers + 1 if lay.zero >= 2 else 0
    # The phalanx trainer runs replicated dp composed with tp or pp through FSDP2 as HSDP with
    # shard size 1 (DDP takes neither DTensors nor stages): FSDP's per-unit cost, DDP's bytes.
    wrapped = n_layers + 1 if lay.zero == 0 and (lay.tp > 1 or lay.pp > 1) else 0
    # Under pp the trainer's FSDP keeps the weights gathered and PyTorch's pipeline stage
    # reduces gradients once, after the last micro-batch: per-step and per-micro-batch costs
    # measured in that mode; otherwise FSDP reshards and is timed per micro-batch.
    if lay.pp > 1:
        fsdp_unit = fw.fsdp_pp_unit_s(lay.world_size, lay.microbatches, queue)
    else:
        fsdp_unit = lay.microbatches * fw.fsdp_unit_s(lay.world_size, queue)
    wrap_cost = wrapped * fsdp_unit
    if lay.zero == 0 and not wrapped:  # DDP: its hooks' collective waits for busy cores (CPUs)
        wrap_cost += fw.ddp_overhead_s(lay.world_size)
    rs = ag = ar_replica = 0.0
    for params, size, stride in groups:
        pieces = collectives or max(1, math.ceil(params * g / BUCKET_BYTES))
        if lay.zero == 0:
            rs += pieces * collective_time(comm.all_reduce, cluster, params * g / pieces, size, stride)
        else:
            rs += pieces * collective_time(comm.reduce_scatter, cluster, params * g / pieces, size, stride)
            ag += pieces * collective_time(comm.all_gather, cluster, params * gathered / pieces, size, stride)
        if lay.replicate > 1:
            ar_replica += pieces * collective_time(comm.all_reduce, cluster, params * g / size / pieces,
                                               lay.replicate, stride * size)
    # gloo runs collectives on the very cores that compute: nothing overlaps on a CPU.
    overlap = options.dp_overlap and not cluster.shared_compute
    one_layer = 1.0 / max(1, n_layers)  # the last bucket (first layer) can never be hidden

    def shown(t: float, window: float) -> float:
        """What a collective hidden behind `window` of compute adds: the part that sticks out
        (at least the last layer's share), plus the SMs its hidden part takes from compute."""
        out = max(t - window, t * one_layer)
        return out + cluster.hidden_comm_cost * (t - out)

    if lay.zero == 3 and lay.pp == 1:
        # Every micro-batch gathers every parameter forward and again backward (resharded after
        # forward; with Options.recompute_regathers also in the recompute forward of the
        # checkpointed layers), whatever dp is: at
        # fixed global batch, compute per micro-batch stays and the micro-batches per rank
        # fall, while each gather's ring latency grows with dp (comm.py), so once these
        # gathers no longer hide under compute, more dp lowers throughput per GPU. The
        # gradients accumulate unsharded and are reduce-scattered after the last micro-batch
        # (with Options.reduce_each_microbatch: after every micro-batch, into the shards).
        m = lay.microbatches
        reduces = m if options.reduce_each_microbatch else 1  # each hidden behind its own backward
        if overlap:
            gathers = m * (shown(ag, st.f) + shown(ag * regathered, st.r) + shown(ag, st.b + st.w))
            reduce = reduces * shown(rs, st.b + st.w)
        else:
            gathers, reduce = (2 + regathered) * m * ag, reduces * rs
        return gathers + reduce + units * fsdp_unit + ar_replica
    if lay.zero == 3:  # under pp: gathered once, reduced once, like zero 1 and 2 below
        wrap_cost = units * fsdp_unit
    reduces = lay.microbatches if options.reduce_each_microbatch and lay.zero == 2 and lay.pp == 1 else 1
    if not overlap:
        return reduces * rs + ag + ar_replica + wrap_cost
    exposed = reduces * shown(rs, st.b + st.w + st.r) + ar_replica
    if ag:
        exposed += shown(ag, st.f)
    return exposed + wrap_cost


FP32_GRAD = 4
"""Bytes per element of the gradients the replica sum adds: the parameters' own (fp32) .grad."""


def replica_sum_time(cluster: Cluster, model: ModelConfig, lay: Layout, expert_slots: int, moe_layers: int) -> float:
    """Seconds per step of `--expert-slots`' replica gradient sum (phalanx/parallel/
    expert_slot_grads.py): once per optimizer step and MoE layer, one all-reduce over the ep
    group of a dense buffer holding the gradients of every replicated expert. S slots for E
    experts replicate at most min(E, S - E) experts (each extra slot one more expert), the
    figure charged: the planner does not know the loads that decide which. Under FSDP (zero 2
    or 3) each slot is sharded over edp = dp / ep inside the slot and a rank sums only its
    slice: 1/edp of the buffer. The buffer lives only during the optimizer step, when the
    activations are gone, so it adds no peak memory."""
    experts = model.n_experts
    if not expert_slots or expert_slots <= experts or lay.ep == 1 or not moe_layers:
        return 0.0
    one_expert = param_counts_of(model).experts / experts
    nbytes = min(experts, expert_slots - experts) * one_expert * FP32_GRAD
    if rules.runs_fsdp(lay.replicas, zero=lay.zero, tp=lay.tp, pp=lay.pp):
        nbytes /= lay.replicas // lay.ep
    # ep ranks are adjacent dp ranks (tp apart); slots run only without folding over tp.
    return moe_layers * collective_time(comm.all_reduce, cluster, nbytes, lay.ep, lay.tp)

