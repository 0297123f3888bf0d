"""From measurements to cluster-file figures: least-squares and two-point fits, torch-free
(each is tested on synthetic samples)."""

from __future__ import annotations

import math
import statistics

from phalanx.calibrate.compute import OVERHEAD_TOKENS, overhead_model
from phalanx.planner.cost import CLIP_BYTES_PER_PARAM, GRAD_ZERO_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM
from phalanx.planner.hardware import Cluster
from phalanx.planner.stage_time import layer_cost, wave_fill


def fit_matmul(samples: list[tuple[int, int, int, float]], sm_count: int = 0) -> tuple[float, float]:
    """(peak FLOP/s, half_dim) minimising the squared log error of the fill model.

    On a GPU the cost model also charges wave quantization over `sm_count` SMs
    (stage_time.wave_fill), so the fit divides it out first rather than let half_dim absorb it.
    """
    best = None
    waves = [wave_fill(m, n, sm_count) for m, n, _, _ in samples]
    for half in [0.0] + [2.0 ** (i / 4) for i in range(0, 48)]:
        fills = [(m / (m + half)) * (n / (n + half)) * (k / (k + half)) * w
                 for (m, n, k, _), w in zip(samples, waves)]
        # For a fixed half, the best log-peak is the mean of log(achieved / fill).
        logs = [math.log(2 * m * n * k / t / f) for (m, n, k, t), f in zip(samples, fills)]
        log_peak = statistics.fmean(logs)
        err = sum((x - log_peak) ** 2 for x in logs)
        if best is None or err < best[0]:
            best = (err, math.exp(log_peak), half)
    return best[1], best[2]


def fit_layer_terms(per_layer: tuple[float, float], flops_s: tuple[float, float],
                    elementwise_s: tuple[float, float]) -> tuple[float, float]:
    """(overhead seconds per layer per pass, fraction of the bandwidth element-wise work reaches)
    from one layer's measured training-step seconds at two sizes.

    The cost model charges a layer F + B + W = flops_s (GEMMs, attention: calibrated on their
    own) + elementwise_s / efficiency (memory-bound passes) + 3 x overhead (fixed, per pass).
    Two sizes give two equations: the growth not explained by the FLOPs is element-wise work,
    what is left at the small size is fixed cost.
    """
    (d1, d2), (g1, g2), (e1, e2) = per_layer, flops_s, elementwise_s
    rest1, rest2 = d1 - g1, d2 - g2
    efficiency = 1.0
    if rest2 > rest1 and e2 > e1:
        efficiency = min(1.0, max(1e-3, (e2 - e1) / (rest2 - rest1)))
    overhead = max(0.0, (rest1 - e1 / efficiency) / 3)
    return overhead, efficiency


def fit_overheads(samples: dict, cluster: Cluster, cores: int) -> dict:
    """Per-layer overhead, element-wise efficiency, step overhead, recompute overhead and the
    thread speedup from measure_overheads' samples, against `cluster`'s FLOP and bandwidth
    figures (one thread per rank, world = cores: as measured)."""

    (m1, s1), (m2, s2) = OVERHEAD_TOKENS
    slope = lambda mbs, seq, t, rc="": (samples[f"5:{mbs}:{seq}:{t}{rc}"] - samples[f"1:{mbs}:{seq}:{t}{rc}"]) / 4  # noqa: E731
    peak, bw = cluster.peak_flops_per_rank(cores), cluster.memory_bw_per_rank(cores)
    # Clipping, AdamW and zeroing of one layer's parameters run once per step, not per
    # micro-batch: take them out of the per-layer slope; beyond their bytes (which the cost
    # model charges already) they are a fixed cost per layer per step.
    tail = max(0.0, slope(m1, s1, 1, ":tail")) if f"1:{m1}:{s1}:1:tail" in samples else 0.0
    tail_bytes = samples.get("block_params", 0.0) * (OPTIMIZER_BYTES_PER_PARAM + CLIP_BYTES_PER_PARAM
                                                     + GRAD_ZERO_BYTES_PER_PARAM) / bw
    d = (slope(m1, s1, 1) - tail, slope(m2, s2, 1) - tail)
    flops, elementwise, forward = [], [], []
    for mbs, seq in OVERHEAD_TOKENS:
        kw = dict(seq=seq, mbs=mbs, tp=1, ep=1, sp=False, moe=False, peak=peak, flash=True, overhead=0.0)
        model = overhead_model(1, seq)
        fast = layer_cost.__wrapped__(model, cluster, memory_bw=float("inf"), **kw)
        slow = layer_cost.__wrapped__(model, cluster, memory_bw=bw, **kw)
        g = fast.f + fast.b + fast.w
        flops.append(g)
        elementwise.append(slow.f + slow.b + slow.w - g)
        forward.append((fast.f, slow.f - fast.f))  # (FLOP, element-wise) seconds of the forward
    overhead, efficiency = fit_layer_terms(d, tuple(flops), tuple(elementwise))
    step = max(0.0, samples[f"1:{m1}:{s1}:1"] - d[0] - tail)
    # The checkpointed step's extra per layer, less the re-run forward the cost model charges
    # on its own (FLOPs, element-wise passes, one pass's fixed cost) and the once-per-step
    # optimizer work that the checkpointed timings include as well.
    rerun = forward[0][0] + forward[0][1] / efficiency + overhead
    recompute = max(0.0, slope(m1, s1, 1, ":rc") - tail - d[0] - rerun)
    speedup = 0.0
    if f"1:{m2}:{s2}:{cores}" in samples and cores > 1:
        one = d[1] - d[0]
        many = slope(m2, s2, cores) - slope(m1, s1, cores)
        speedup = min(float(cores), max(1.0, one / many)) if many > 0 and one > 0 else 1.0
    return {"layer_overhead_us": overhead * 1e6, "elementwise_efficiency": efficiency,
            "step_overhead_ms": step * 1e3, "recompute_overhead_us": recompute * 1e6, "thread_speedup": speedup,
            "optimizer_layer_overhead_us": max(0.0, tail - tail_bytes) * 1e6,
            "per_layer_s": d, "flops_s": flops, "elementwise_s": elementwise}


def all_reduce_s(fit: dict[str, float], world: int, nbytes: float) -> float:
    """Seconds of a ring all-reduce of `nbytes` on `world` ranks under `fit_alpha_beta`'s fit."""
    return 2 * (world - 1) * fit["latency_us"] * 1e-6 + 2 * (world - 1) / world * nbytes / (fit["bus_bw_gbs"] * 1e9)


def fit_alpha_beta(samples: dict[str, float], world: int) -> dict[str, float]:
    """Latency (us per ring step) and bus bandwidth (GB/s) of all-reduce on `world` ranks.

    The smallest message gives alpha (t / 2(n-1)); the largest gives beta after removing
    alpha. A joint least-squares fit is dominated by the large messages and lets alpha go
    negative on a noisy shared machine, so the two ends are read separately.
    """
    sizes = sorted(int(k.split(":")[1]) for k in samples if k.startswith("all_reduce:"))
    steps = 2 * (world - 1)
    alpha = samples[f"all_reduce:{sizes[0]}"] / steps
    largest = sizes[-1]
    t = samples[f"all_reduce:{largest}"]
    volume = 2 * (world - 1) / world * largest
    return {"latency_us": alpha * 1e6, "bus_bw_gbs": volume / max(t - steps * alpha, 1e-9) / 1e9}


def fit_tp_overheads(sample: dict, bus_bw_gbs: float) -> dict:
    """Tensor parallelism's framework costs per layer per pass from `wrapper_overhead_worker`'s
    tp sample: the growth of the extra time from 8 tokens to a real micro-batch, less what the
    cost model already charges for its 2 all-reduces per forward and backward of tokens x dim bf16
    values at `bus_bw_gbs` on 2 processes (2(n-1)/n = 1 x the bytes; 4 all-reduces over 3
    passes), per element of the activation (`tp_element_overhead_ns`, never negative); the fixed
    part (`tp_layer_overhead_us`) is what is left of the real micro-batch's extra time after
    both; sequence
    parallelism's own fixed cost (`sp_layer_overhead_us`: its DTensor norms, gathers and
    scatters) is the real micro-batch's extra time with it less that without it, less the bytes
    of its backward re-gathers."""
    def bytes_us(elements: float) -> float:
        return 4 / 3 * 2 * elements * 2 / (bus_bw_gbs * 1e9) * 1e6

    small, large = sample["small_elements"], sample["large_elements"]
    growth = sample["large_us"] - sample["small_us"] - (bytes_us(large) - bytes_us(small))
    element_ns = max(0.0, growth / (large - small) * 1e3)
    fixed_us = max(0.0, sample["large_us"] - element_ns * 1e-3 * large - bytes_us(large))
    # The trainer's sp gathers the attention and MLP inputs again in backward
    # (parallel/sequence_parallel.py), which the cost model charges itself (Options.sp_regather):
    # 2 all-gathers of elements bf16 values at (n-1)/n = 1/2 of the bytes, over the 3 passes.
    regather_us = 2 / 3 * 2 * large * 2 / 2 / (bus_bw_gbs * 1e9) * 1e6
    sp_us = max(0.0, sample["large_sp_us"] - sample["large_us"] - regather_us)
    return {"tp_layer_overhead_us": fixed_us, "tp_element_overhead_ns": element_ns, "sp_layer_overhead_us": sp_us}


def fit_tp_step(sample: dict) -> dict:
    """What tensor parallelism (with sp) adds beyond its layers: per micro-batch, the extra
    forward+backward time of the model at 0 blocks (embedding, output, the vocabulary-parallel
    loss), read as the intercept of the line through 1 and 9 blocks (a model needs a block);
    per layer per step, the slope over 1 -> 9 blocks of the extra clipping, AdamW and zeroing
    time (their per-tensor DTensor dispatch)."""
    extra = {(key, n): sample[f"{key}:{n}:1"] - sample[f"{key}:{n}:0"] for key in ("step", "tail") for n in (1, 9)}
    root = extra[("step", 1)] - (extra[("step", 9)] - extra[("step", 1)]) / 8
    return {"tp_microbatch_overhead_us": max(0.0, root) * 1e6,
            "tp_optimizer_layer_overhead_us": max(0.0, (extra[("tail", 9)] - extra[("tail", 1)]) / 8) * 1e6}


def fit_fsdp_pp(sample: dict) -> dict:
    """Per unit per step and per unit per micro-batch (us) from `_fsdp_pp_worker`'s extra
    seconds at (blocks, micro-batches) = (1|5, 1|3): the slope over 4 blocks is a + b m."""
    s1 = (sample["5:1"] - sample["1:1"]) / 4
    s3 = (sample["5:3"] - sample["1:3"]) / 4
    per_mb = max(0.0, (s3 - s1) / 2)
    return {"fsdp_pp_unit_overhead_us": max(0.0, s1 - per_mb) * 1e6, "fsdp_pp_microbatch_overhead_us": per_mb * 1e6}


def fit_split_rerun(sample: dict) -> float:
    """Microseconds each forward re-run of a checkpointed block costs under the split backward
    beyond the block's forward itself: the recompute's extra per micro-batch on the rank,
    shared among its re-runs, less one forward (timed alone at the same size)."""
    per_rerun = sample["recompute_per_mb_s"] / sample["reruns_per_mb"]
    return max(0.0, per_rerun - sample["block_forward_s"]) * 1e6
