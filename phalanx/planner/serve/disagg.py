"""Prefill/decode disaggregation (DistServe, Dynamo, SGLang's PD): some GPUs only run prompts,
the rest only decode, and each request's KV cache crosses from one to the other.

For every split of the GPUs into a prefill and a decode side that are both whole allocations
(cluster.check_device_count; at most MAX_SPLITS, evenly spaced), each side gets its own best layout from the phase-only search
(`--phase prefill`: input tokens/s; `--phase decode`: output tokens/s within the TPOT target).
The deployment serves the smaller of the two sides' request rates; TTFT is the prompt's
prefill alone plus the transfer of its whole KV cache (every layer, all heads) through the
prefill GPU's NIC (the two sides sit on different nodes), plus M/D/1 queueing at the prefill
side; TPOT is the decode side's step, with no prompt in it (the point of disaggregating).
"""

from __future__ import annotations

import dataclasses

from phalanx.errors import UserError
from phalanx.model.config import ModelConfig
from phalanx.planner.hardware import Cluster
from phalanx.planner.kv_cache import kv_bytes_per_token
from phalanx.planner.serve.rates import Rates, ServeLoad
from phalanx.planner.serve.search import ServePlan, phalanx_serve_gaps, search_serving
from phalanx.planner.serve.step import KV_BYTES


MAX_SPLITS = 4
"""Splits tried at most, evenly spaced: each costs two phase-only searches, and the search
must stay under a second for a rack."""


def _splits(cluster: Cluster, gpus: int) -> list[int]:
    """Prefill GPU counts p such that p and gpus - p are both allocations a job gets, at most
    MAX_SPLITS of them, evenly spaced in whole nodes (or whole GPUs below a node)."""
    unit = cluster.devices_per_node if gpus > cluster.devices_per_node and not cluster.shared_compute else 1
    step = max(unit, (gpus // MAX_SPLITS) // unit * unit)
    out = []
    for p in range(step, gpus, step):
        try:
            cluster.check_device_count(p)
            cluster.check_device_count(gpus - p)
        except UserError:
            continue
        out.append(p)
    return out


def kv_transfer_seconds(model: ModelConfig, cluster: Cluster, *, tokens: int, kv_dtype: str) -> float:
    """One prompt's KV cache (all layers) from a prefill GPU to a decode GPU over the NIC."""
    nbytes = tokens * kv_bytes_per_token(model, bytes_per_value=KV_BYTES[kv_dtype])
    return nbytes / (cluster.inter_bw_gbs * 1e9) + cluster.inter_latency_us * 1e-6


def disaggregated(model: ModelConfig, cluster: Cluster, load: ServeLoad, *, gpus: int, fixed: dict[str, int],
                  weight_dtype: str, kv_dtype: str) -> tuple[list[ServePlan], int]:
    """The best plan of every split (best first), and how many side layouts were rated."""
    plans, considered = [], 0
    side_fix = {k: v for k, v in fixed.items() if k not in ("max_batch", "max_batch_tokens")}
    for p in _splits(cluster, gpus):
        d = gpus - p
        pre_load = dataclasses.replace(load, phase="prefill", tpot_ms=None, ttft_ms=None, rate=None, concurrency=None)
        dec_load = dataclasses.replace(load, phase="decode", ttft_ms=None, rate=None)
        pre = search_serving(model, cluster, pre_load, gpus=p, weight_dtype=weight_dtype, kv_dtype=kv_dtype, keep=1,
                             fixed={**side_fix, **({"max_batch_tokens": fixed["max_batch_tokens"]}
                                                   if "max_batch_tokens" in fixed else {})})
        dec = search_serving(model, cluster, dec_load, gpus=d, weight_dtype=weight_dtype, kv_dtype=kv_dtype, keep=1,
                             fixed={**side_fix, **({"max_batch": fixed["max_batch"]} if "max_batch" in fixed else {})})
        considered += pre.considered + dec.considered
        if not (pre.ranked and dec.ranked):
            continue
        plans.append(_combine(model, cluster, load, pre.ranked[0], dec.ranked[0], p=p, d=d, kv_dtype=kv_dtype))
    plans.sort(key=lambda plan: plan.key, reverse=True)
    return plans, considered


def _combine(model, cluster, load: ServeLoad, pre: ServePlan, dec: ServePlan, *, p: int, d: int,
             kv_dtype: str) -> ServePlan:
    prefill_rate = pre.rates.input_tps_gpu * p / load.isl  # requests/s the prefill side takes
    decode_rate = dec.rates.output_tps_gpu * d / load.osl
    capacity = min(prefill_rate, decode_rate)
    ttft = pre.rates.ttft_s + kv_transfer_seconds(model, cluster, tokens=load.isl, kv_dtype=kv_dtype)
    tpot = dec.rates.tpot_p50_s
    overloaded = load.rate is not None and load.rate > capacity
    served = capacity if load.rate is None or overloaded else load.rate
    if load.rate is not None and not overloaded:
        rho = load.rate / prefill_rate
        ttft += rho / (2 * (1 - rho)) * pre.rates.ttft_s
    meets = ((load.tpot_ms is None or tpot <= load.tpot_ms / 1e3)
             and (load.ttft_ms is None or (ttft <= load.ttft_ms / 1e3 and not overloaded)))
    targets = load.tpot_ms is not None or load.ttft_ms is not None
    goodput = (served if meets else 0.0) if targets else served
    rates = Rates(batch=dec.rates.batch, ttft_s=ttft, tpot_p50_s=tpot, tpot_p99_s=dec.rates.tpot_p99_s,
                  output_tps_gpu=served * load.osl / (p + d), input_tps_gpu=served * load.isl / (p + d),
                  goodput=goodput, overloaded=overloaded, breakdown=dec.rates.breakdown)
    notes = tuple(dict.fromkeys([*phalanx_serve_gaps(pre.layout, instances=pre.instances),
                                 *phalanx_serve_gaps(dec.layout, instances=dec.instances, disaggregated=True)]))
    return ServePlan(layout=dec.layout, instances=dec.instances, max_batch=dec.max_batch,
                     max_batch_tokens=pre.max_batch_tokens, rates=rates, memory=dec.memory, prefill_gpus=p,
                     decode_gpus=d, prefill_layout=pre.layout, prefill_instances=pre.instances, notes=notes,
                     expert_load=dec.expert_load, imbalance_one_slot_each=dec.imbalance_one_slot_each)
