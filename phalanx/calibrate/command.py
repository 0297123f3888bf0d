"""Measure this machine and write the cluster file that `--cluster local` reads.

What is measured, and which Cluster field it sets:
  matrix multiplies over a range of shapes -> peak_tflops and matmul_half_dim (least-squares
    fit of t = 2mnk / (peak f(m) f(n) f(k) wave), f(d) = d / (d + half), wave the SMs' wave
    fill on a GPU, sm_count read off the device), matmul_efficiency = 1;
  causal scaled-dot-product attention forward+backward -> attention_efficiency;
  a large element-wise add -> hbm_tbs (memory bandwidth);
  training steps of a model too small for its FLOPs to count, at two depths ->
    layer_overhead_us (slope) and step_overhead_ms (intercept: loss, clipping, AdamW);
  FSDP2 on 2 gloo processes, with and without sharding, at two depths ->
    fsdp_unit_overhead_us (framework cost per sharded layer per micro-batch); the same with
    phalanx's own tensor-parallel plan (apply_tp) at 8 tokens and at a real micro-batch, with
    and without sequence parallelism -> tp_layer_overhead_us (DTensor dispatch per pass),
    tp_element_overhead_ns (what grows with the activation) and sp_layer_overhead_us;
  DDP, FSDP under pipeline parallelism and the pipeline runtime on the trainer's own code
    paths (CPU only; see runtimes.py) -> ddp_step_overhead_ms per group size,
    fsdp_pp_unit_overhead_us, fsdp_pp_microbatch_overhead_us, pp_action_overhead_us per schedule;
  all-reduce and all-gather over 2..max_procs processes with the real backend (gloo on CPU,
    NCCL on GPU) at several sizes -> alpha (latency) and beta (bandwidth) per group size by a
    linear fit; their medians become intra_latency_us and intra_bw_gbs.
On a CPU, `cores` concurrent single-threaded matmul workers then measure the share of the
machine the job really gets over time (the figures above keep their fastest repeat); peak
and bandwidth are multiplied, the fixed costs divided, by that share.
Every figure is printed, and the per-group-size fits are saved beside the cluster file.
"""

from __future__ import annotations

import json
import os
import statistics

from phalanx.calibrate.compute import (
    OVERHEAD_MODEL,
    OVERHEAD_TOKENS,
    measure_attention,
    measure_bandwidth,
    measure_matmuls,
    measure_overheads,
)
from phalanx.calibrate.fit import fit_alpha_beta, fit_matmul, fit_overheads, fit_tp_overheads
from phalanx.calibrate.runtimes import measure_runtime_overheads
from phalanx.calibrate.workers import measure_collectives, measure_delivered_share, timeit
from phalanx.calibrate.wrappers import measure_tp_overhead
from phalanx.errors import UserError
from phalanx.output_path import check_output_file
from phalanx.planner.framework_costs import FrameworkCosts
from phalanx.planner.hardware import Cluster, cluster_to_dict, local_cluster_path
from phalanx.process_count import check_process_count


def calibrate(*, max_procs: int, backend: str, quick: bool, log=print) -> tuple[Cluster, dict]:
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    gpu = backend == "nccl"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32  # CPUs train in float32
    report: dict = {"backend": backend, "device": str(device), "dtype": str(dtype)}

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not gpu:
        # One thread, scaled by the core count: a multi-threaded tiny op on a busy machine
        # waits for its slowest (descheduled) thread and measures the neighbours, not the CPU.
        threads_before = torch.get_num_threads()
        torch.set_num_threads(1)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count if gpu else 0
    samples = measure_matmuls(device, dtype, quick=quick)
    peak, half = fit_matmul(samples, sm_count)
    peak *= 1 if gpu else cores
    report["matmul"] = [{"m": m, "n": n, "k": k, "seconds": t, "tflops": 2 * m * n * k / t / 1e12}
                        for m, n, k, t in samples]
    for row in report["matmul"]:
        log(f"matmul {row['m']:>5} x {row['k']:>5} @ {row['k']:>5} x {row['n']:>5}: {row['tflops'] * 1e3:8.2f} GFLOP/s")
    log(f"fit: peak {peak / 1e12 * 1e3:.2f} GFLOP/s, half-efficiency dimension {half:.1f}")
    attention = measure_attention(device, dtype, peak / (1 if gpu else cores), quick=quick)
    bandwidth = measure_bandwidth(device, quick=quick)
    overhead = step_overhead = recompute_overhead = thread_speedup = optimizer_layer = 0.0
    element_efficiency = 1.0
    if not gpu:
        # The real Transformer's training step at one thread (as a rank per core runs) and at
        # all cores' threads (as a lone process runs): fixed costs, element-wise efficiency,
        # and how far the size-dependent work speeds up with threads.
        raw = measure_overheads(device, quick=quick, threads=(1, cores) if cores > 1 else (1,))
        provisional = Cluster(name="fit", devices_per_node=cores, fast_domain=cores, peak_tflops=peak / 1e12,
                              hbm_tbs=bandwidth, hbm_efficiency=1.0, matmul_efficiency=1.0, matmul_half_dim=half,
                              attention_efficiency=max(attention, 1e-3), shared_compute=True)
        fit = fit_overheads(raw, provisional, cores)
        report["overheads"] = {"samples": raw, **fit}
        overhead, step_overhead = fit["layer_overhead_us"], fit["step_overhead_ms"]
        recompute_overhead, element_efficiency = fit["recompute_overhead_us"], fit["elementwise_efficiency"]
        thread_speedup = fit["thread_speedup"]
        optimizer_layer = fit["optimizer_layer_overhead_us"]
        log(f"real layer, one thread: {fit['per_layer_s'][0] * 1e3:.2f} ms at {OVERHEAD_TOKENS[0][0] * OVERHEAD_TOKENS[0][1]} "
            f"tokens, {fit['per_layer_s'][1] * 1e3:.2f} ms at {OVERHEAD_TOKENS[1][0] * OVERHEAD_TOKENS[1][1]} tokens "
            f"(FLOPs explain {fit['flops_s'][1] * 1e3:.2f} ms): element-wise work at {element_efficiency:.2f} of the "
            f"measured bandwidth; {cores} threads run it {thread_speedup:.2f}x as fast as one")
    share = 1.0
    if not gpu:
        square = torch.randn(256, 256)
        single = 2 * 256**3 / timeit(lambda: torch.matmul(square, square), repeats=20, best=True)
        share = measure_delivered_share(cores, single, quick=quick)
        log(f"{cores} concurrent single-thread workers get {share:.0%} of {cores} x the best single-thread "
            "throughput: every CPU figure is scaled by that share")
        peak, bandwidth = peak * share, bandwidth * share
        overhead, step_overhead, recompute_overhead, optimizer_layer = (
            x / share for x in (overhead, step_overhead, recompute_overhead, optimizer_layer))
        torch.set_num_threads(threads_before)
    log(f"attention at {attention:.2f} of peak; memory bandwidth {bandwidth * 1e3:.1f} GB/s; "
        f"overhead {overhead:.0f} us per layer per pass, {step_overhead:.2f} ms per step, "
        f"{recompute_overhead:.0f} us per recomputed layer, {optimizer_layer:.0f} us per layer per step "
        "(clipping, AdamW, zeroing beyond their bytes)")

    devices = torch.cuda.device_count() if gpu else cores
    fits = {}
    for world in range(2, max(2, max_procs) + 1):
        if gpu and world > devices:
            break
        measured = measure_collectives(world, backend, quick=quick)
        fits[world] = fit_alpha_beta(measured, world)
        report.setdefault("collectives", {})[str(world)] = {"samples": measured, **fits[world]}
        log(f"{backend} {world} processes: latency {fits[world]['latency_us']:.1f} us per step, "
            f"bus bandwidth {fits[world]['bus_bw_gbs']:.2f} GB/s")
    tp_overhead = tp_element = sp_overhead = 0.0
    if not gpu:
        tp_sample = measure_tp_overhead(quick=quick)
        tp_fit = fit_tp_overheads(tp_sample, fits[2]["bus_bw_gbs"] if 2 in fits else 1.0)
        report["tp_overhead"] = {"samples": tp_sample, **tp_fit}
        tp_overhead, tp_element, sp_overhead = (
            tp_fit[k] / share for k in ("tp_layer_overhead_us", "tp_element_overhead_ns", "sp_layer_overhead_us"))
        log(f"tensor parallelism "
            f"{tp_overhead:.0f} us per layer per pass plus {tp_element:.3f} ns per activation element "
            f"({tp_sample['small_us']:.0f} us at 8 tokens, {tp_sample['large_us']:.0f} us at "
            f"{tp_sample['large_elements'] // OVERHEAD_MODEL['dim']}), sequence parallelism "
            f"{sp_overhead:.0f} us more per layer per pass; all beyond their collectives")
    runtime: dict = {}
    fsdp_overhead = 0.0
    if not gpu:

        runtime = measure_runtime_overheads(max_procs=max_procs, collective_fits=fits, quick=quick, log=log)
        report["runtime_overheads"] = runtime
        runtime = dict(  # fixed costs, scaled by the machine's delivered share like the others
            runtime, ddp_step_overhead_ms=tuple((n, ms / share) for n, ms in runtime["ddp_step_overhead_ms"]),
            pp_action_overhead_us=tuple((s, us / share) for s, us in runtime["pp_action_overhead_us"]),
            fsdp_unit_overhead_groups=tuple((n, us / share) for n, us in runtime["fsdp_unit_overhead_groups"]),
            fsdp_pp_overhead_groups=tuple((n, a / share, b / share) for n, a, b in runtime["fsdp_pp_overhead_groups"]),
            fsdp_pp_unit_overhead_us=runtime["fsdp_pp_unit_overhead_us"] / share,
            fsdp_pp_microbatch_overhead_us=runtime["fsdp_pp_microbatch_overhead_us"] / share,
            split_rerun_overhead_us=runtime["split_rerun_overhead_us"] / share,
            tp_microbatch_overhead_us=runtime["tp_microbatch_overhead_us"] / share,
            tp_optimizer_layer_overhead_us=runtime["tp_optimizer_layer_overhead_us"] / share)
        fsdp_overhead = dict(runtime["fsdp_unit_overhead_groups"]).get(2, 0.0)  # the 2-process figure
    bw = statistics.median(f["bus_bw_gbs"] for f in fits.values()) if fits else 1.0
    latency = statistics.median(f["latency_us"] for f in fits.values()) if fits else 50.0

    if gpu:
        props = torch.cuda.get_device_properties(0)
        memory_gib = props.total_memory / 2**30
    else:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cluster = Cluster(
        name="local", devices_per_node=devices, fast_domain=devices, peak_tflops=peak / 1e12,
        memory_gib=round(memory_gib, 2), memory_reserved_gib=round(min(4.0, memory_gib / 4), 2),
        hbm_tbs=bandwidth, hbm_efficiency=1.0, elementwise_efficiency=element_efficiency, intra_bw_gbs=bw, inter_bw_gbs=bw, intra_latency_us=latency, inter_latency_us=latency,
        matmul_efficiency=1.0, matmul_half_dim=half, sm_count=sm_count, attention_efficiency=max(attention, 1e-3),
        shared_compute=not gpu, comm_sm_fraction=Cluster.comm_sm_fraction if gpu else 0.0,
        thread_speedup=thread_speedup,
        measured_groups=tuple((w, f["latency_us"], f["bus_bw_gbs"]) for w, f in sorted(fits.items())),
        framework=FrameworkCosts(
            layer_overhead_us=overhead, step_overhead_ms=step_overhead, fsdp_unit_overhead_us=fsdp_overhead,
            tp_layer_overhead_us=tp_overhead, tp_element_overhead_ns=tp_element, sp_layer_overhead_us=sp_overhead,
            recompute_overhead_us=recompute_overhead, optimizer_layer_overhead_us=optimizer_layer, **runtime),
    )
    return cluster, report


def calibrate_command(args) -> int:
    if args.max_procs < 2:  # before 30-45 s of measuring, as the output's place below
        raise UserError(f"--max-procs {args.max_procs}: the collectives are measured over groups of 2 up to it, "
                        "so it must be at least 2")
    check_process_count(args.max_procs, "--max-procs")
    out = check_output_file(args.out if args.out else local_cluster_path(), "--out")
    check_output_file(out.with_suffix(".measurements.json"), "--out")
    cluster, report = calibrate(max_procs=args.max_procs, backend=args.backend, quick=args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cluster_to_dict(cluster), indent=2) + "\n")
    side = out.with_suffix(".measurements.json")
    side.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} (cluster file) and {side} (raw measurements)")
    return 0
