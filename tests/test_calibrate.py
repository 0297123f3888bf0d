"""Calibration: the fits recover known figures, and a real gloo run writes a loadable file."""

import json

import pytest

from phalanx import cli
from phalanx.calibrate.fit import fit_alpha_beta, fit_matmul
from phalanx.planner.hardware import load_cluster_file


def test_fit_matmul_recovers_peak_and_half_dimension():
    peak, half = 2e11, 64.0
    fill = lambda d: d / (d + half)  # noqa: E731
    shapes = [(s, s, s) for s in (32, 64, 128, 512, 2048)] + [(2048, 2048, 32)]
    samples = [(m, n, k, 2 * m * n * k / (peak * fill(m) * fill(n) * fill(k))) for m, n, k in shapes]
    got_peak, got_half = fit_matmul(samples)
    assert got_half == pytest.approx(half, rel=0.1)  # the grid steps by 2^(1/4)
    assert got_peak == pytest.approx(peak, rel=0.1)


def test_fit_alpha_beta_reads_latency_and_bandwidth():
    # 4 ranks, alpha 100 us per step, 2 GB/s: t = 6 alpha + 1.5 S / 2e9.
    world, alpha, bw = 4, 100e-6, 2e9
    samples = {f"all_reduce:{s}": 6 * alpha + 1.5 * s / bw for s in (4096, 1 << 20, 1 << 24)}
    fit = fit_alpha_beta(samples, world)
    # The smallest message carries 4096 * 1.5 / 2e9 = 3 us of transfer: alpha is read 0.5% high.
    assert fit["latency_us"] == pytest.approx(100.5, rel=1e-3)
    assert fit["bus_bw_gbs"] == pytest.approx(2.0, rel=1e-3)


def test_calibrate_with_gloo_writes_a_cluster_file(tmp_path, capsys, monkeypatch):
    from phalanx.calibrate.workers import SMOKE_ENV

    # Every measurement on its real code path, but timed once: this test checks the file and
    # its fields, not the figures (the fits' arithmetic is tested above on synthetic timings).
    monkeypatch.setenv(SMOKE_ENV, "1")
    out = tmp_path / "local.json"
    assert cli.run(["calibrate", "--quick", "--max-procs", "2", "--backend", "gloo", "--out", str(out)]) == 0
    cluster = load_cluster_file(out)
    assert cluster.shared_compute and cluster.peak_tflops > 0
    assert [g[0] for g in cluster.measured_groups] == [2]
    latency, bw = cluster.intra_link(2)
    assert latency > 0 and bw > 0
    raw = json.loads(out.with_suffix(".measurements.json").read_text())
    assert raw["backend"] == "gloo" and "2" in raw["collectives"]
    assert "gloo 2 processes" in capsys.readouterr().out
    # The trainer's runtimes, measured on their own code paths: DDP per group size, FSDP under
    # pp, and the pipeline runtime per schedule.
    assert [n for n, _ in cluster.framework.ddp_step_overhead_ms] == [2]
    assert [n for n, _ in cluster.framework.fsdp_unit_overhead_groups] == [2]
    assert [g[0] for g in cluster.framework.fsdp_pp_overhead_groups] == [2]
    assert cluster.framework.fsdp_unit_overhead_us == cluster.framework.fsdp_unit_overhead_groups[0][1]
    assert [s for s, _ in cluster.framework.pp_action_overhead_us] == ["1f1b", "interleaved", "zbv", "dualpipev"]
    assert all(us >= 0 for _, us in cluster.framework.pp_action_overhead_us) and cluster.framework.fsdp_pp_unit_overhead_us >= 0
    assert set(raw["runtime_overheads"]) >= {"ddp_step_overhead_ms", "pp_action_overhead_us", "split_rerun_overhead_us"}


def test_fit_split_rerun_shares_the_recompute_among_reruns_less_the_forward():
    from phalanx.calibrate.fit import fit_split_rerun

    # 20 re-runs per micro-batch of 0.5 ms each, of which 0.2 ms is the block's forward.
    sample = {"recompute_per_mb_s": 20 * 0.5e-3, "reruns_per_mb": 20, "block_forward_s": 0.2e-3}
    assert fit_split_rerun(sample) == pytest.approx(300.0)


def test_fit_tp_step_reads_the_root_cost_and_the_optimizer_slope():
    from phalanx.calibrate.fit import fit_tp_step

    # Truth: 6 ms per micro-batch for the root under tp, 1.5 ms per layer per step of DTensor
    # optimizer work; layers cost 15 ms each under tp, 7 ms plain (cancelled by the fit).
    sample = {}
    for n in (1, 9):  # the 0-block figure is the line's intercept
        sample[f"step:{n}:0"], sample[f"step:{n}:1"] = 2e-3 + 7e-3 * n, 8e-3 + 15e-3 * n
        sample[f"tail:{n}:0"], sample[f"tail:{n}:1"] = 0.3e-3 + 0.3e-3 * n, 1.8e-3 + 1.8e-3 * n
    fit = fit_tp_step(sample)
    assert fit["tp_microbatch_overhead_us"] == pytest.approx(6000.0)
    assert fit["tp_optimizer_layer_overhead_us"] == pytest.approx(1500.0)


def test_fit_fsdp_pp_splits_per_step_and_per_microbatch_costs():
    from phalanx.calibrate.fit import fit_fsdp_pp

    # Extra seconds at (blocks:micro-batches): a = 0.7 ms per unit per step, b = 0.3 ms per
    # unit per micro-batch, plus a root/intercept of 2 ms that the slope over blocks cancels.
    extra = {f"{n}:{m}": n * (0.7e-3 + 0.3e-3 * m) + 2e-3 for n in (1, 5) for m in (1, 3)}
    fit = fit_fsdp_pp(extra)
    assert fit["fsdp_pp_unit_overhead_us"] == pytest.approx(700.0)
    assert fit["fsdp_pp_microbatch_overhead_us"] == pytest.approx(300.0)


def test_fit_matmul_divides_out_wave_quantization_on_a_gpu():
    # Samples made with the wave fill of 132 SMs: 512^2 has 4 x 2 = 8 tiles, 8/132 of the SMs.
    from phalanx.planner.stage_time import wave_fill
    peak, half = 7e14, 96.0
    fill = lambda d: d / (d + half)  # noqa: E731
    shapes = [(s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192)] + [(8192, 8192, 256)]
    samples = [(m, n, k, 2 * m * n * k / (peak * fill(m) * fill(n) * fill(k) * wave_fill(m, n, 132)))
               for m, n, k in shapes]
    got_peak, got_half = fit_matmul(samples, 132)
    assert got_half == pytest.approx(half, rel=0.1)
    assert got_peak == pytest.approx(peak, rel=0.1)


def test_fit_layer_terms_splits_fixed_and_elementwise_cost():
    from phalanx.calibrate.fit import fit_layer_terms

    # Truth: 200 us per pass fixed, element-wise work at 0.25 of the bandwidth.
    overhead, eff = 200e-6, 0.25
    flops, elementwise = (1e-5, 3e-3), (1e-5, 6e-4)
    measured = tuple(g + e / eff + 3 * overhead for g, e in zip(flops, elementwise))
    got_overhead, got_eff = fit_layer_terms(measured, flops, elementwise)
    assert got_overhead == pytest.approx(overhead, rel=1e-6)
    assert got_eff == pytest.approx(eff, rel=1e-6)
    # Nothing beyond the FLOPs grows with size: efficiency 1, the rest is fixed.
    assert fit_layer_terms((1e-3, 1e-3 + 3e-3 - 1e-5 + 6e-4 - 1e-5), flops, elementwise)[1] == pytest.approx(1.0)


def test_thread_speedup_sets_a_lone_process_rate():
    from phalanx.planner.hardware import Cluster

    base = dict(devices_per_node=4, fast_domain=4, peak_tflops=0.4, shared_compute=True, memory_gib=8.0,
                memory_reserved_gib=1.0)
    ideal, measured = Cluster(**base), Cluster(**base, thread_speedup=1.6)
    # One thread per core or more: each rank a core's 0.1 TFLOP/s, speedup or not.
    assert measured.peak_flops_per_rank(4) == pytest.approx(0.1e12)
    assert measured.peak_flops_per_rank(8) == pytest.approx(ideal.peak_flops_per_rank(8))
    # A lone process: 4 threads at 1.6x one thread, not 4x; 2 processes of 2 threads: 1.2x each.
    assert ideal.peak_flops_per_rank(1) == pytest.approx(0.4e12)
    assert measured.peak_flops_per_rank(1) == pytest.approx(0.16e12)
    assert measured.peak_flops_per_rank(2) == pytest.approx(0.12e12)
    assert measured.memory_bw_per_rank(1) / ideal.memory_bw_per_rank(1) == pytest.approx(0.4)


def test_fit_tp_overheads_splits_fixed_per_element_and_sp_costs():
    from phalanx.calibrate.fit import fit_tp_overheads

    # Truth: 2000 us fixed, 10 ns per element, sp 2700 us more; at 1 GB/s the model's own
    # bytes term per pass is 4/3 x 2 all-reduces x elements x 2 bytes: 349.525 us at 65536.
    def bytes_us(elements):
        return 4 / 3 * 2 * elements * 2 / 1e9 * 1e6

    assert bytes_us(65536) == pytest.approx(349.525, abs=1e-3)
    small, large = 2000 + 5.12 + bytes_us(512), 2000 + 655.36 + bytes_us(65536)
    # sp also pays its backward re-gathers: 2 all-gathers of the activation over 3 passes at half
    # its bytes, which the model charges apart (Options.sp_regather)
    regather = 2 / 3 * 2 * 65536 * 2 / 2 / 1e9 * 1e6
    sample = dict(small_us=small, large_us=large, large_sp_us=large + 2700 + regather, small_elements=512,
                  large_elements=65536)
    got = fit_tp_overheads(sample, 1.0)
    assert got["tp_element_overhead_ns"] == pytest.approx(10.0, rel=1e-6)
    assert got["tp_layer_overhead_us"] == pytest.approx(2000, rel=1e-6)
    assert got["sp_layer_overhead_us"] == pytest.approx(2700, rel=1e-6)
    # Extra time that shrinks with size: no per-element cost, all of it fixed.
    flat = fit_tp_overheads(dict(sample, large_us=1900.0, large_sp_us=1800.0), 1.0)
    assert flat["tp_element_overhead_ns"] == 0.0 and flat["sp_layer_overhead_us"] == 0.0
    assert flat["tp_layer_overhead_us"] == pytest.approx(1900.0 - 349.525, abs=1e-3)


def test_fit_overheads_charges_recompute_only_its_framework_cost():
    """Synthetic timings built from known truths: the fit recovers the per-layer overhead and
    the checkpointing cost beyond the re-run forward and the per-step optimizer work (which the
    cost model charges on their own)."""
    from phalanx.calibrate.compute import OVERHEAD_TOKENS, overhead_model
    from phalanx.calibrate.fit import fit_overheads
    from phalanx.planner.stage_time import layer_cost
    from phalanx.planner.hardware import Cluster

    cluster = Cluster(name="cpu", devices_per_node=1, fast_domain=1, peak_tflops=0.1, memory_gib=8.0,
                      memory_reserved_gib=1.0, hbm_tbs=0.03, hbm_efficiency=1.0, matmul_efficiency=1.0,
                      matmul_half_dim=0.0, shared_compute=True)
    overhead, eff, recompute, tail, step = 150e-6, 0.25, 900e-6, 200e-6, 5e-4
    peak, bw = cluster.peak_flops_per_rank(1), cluster.memory_bw_per_rank(1)
    samples = {}
    for i, (mbs, seq) in enumerate(OVERHEAD_TOKENS):
        kw = dict(seq=seq, mbs=mbs, tp=1, ep=1, sp=False, moe=False, peak=peak, flash=True, overhead=0.0)
        fast = layer_cost.__wrapped__(overhead_model(1, seq), cluster, memory_bw=float("inf"), **kw)
        slow = layer_cost.__wrapped__(overhead_model(1, seq), cluster, memory_bw=bw, **kw)
        gemm = fast.f + fast.b + fast.w
        layer = gemm + (slow.f + slow.b + slow.w - gemm) / eff + 3 * overhead
        forward = fast.f + (slow.f - fast.f) / eff + overhead
        for n in (1, 5):
            samples[f"{n}:{mbs}:{seq}:1"] = step + n * (layer + tail)
            if i == 0:
                samples[f"{n}:{mbs}:{seq}:1:rc"] = step + n * (layer + tail + forward + recompute)
                samples[f"{n}:{mbs}:{seq}:1:tail"] = n * tail
    fit = fit_overheads(samples, cluster, cores=1)
    assert fit["layer_overhead_us"] == pytest.approx(overhead * 1e6, rel=1e-6)
    assert fit["elementwise_efficiency"] == pytest.approx(eff, rel=1e-6)
    assert fit["recompute_overhead_us"] == pytest.approx(recompute * 1e6, rel=1e-6)
    assert fit["step_overhead_ms"] == pytest.approx(step * 1e3, rel=1e-6)


def _flaky_worker(rank, world, port, marker, queue):
    """Dies on its first run (no marker file yet), reports on the second."""
    import os
    import sys

    if not os.path.exists(marker):
        if rank == 0:
            open(marker, "w").close()
        sys.exit(3)
    if rank == 0:
        queue.put({"ok": world})


def _dying_worker(rank, world, port, queue):
    import sys

    sys.exit(5)


def test_run_workers_retries_a_failed_group_and_reports_a_lost_one(tmp_path):
    import time

    from phalanx.errors import UserError
    from phalanx.calibrate.workers import run_workers

    marker = str(tmp_path / "first-run")
    assert run_workers(_flaky_worker, 2, (marker,), start_method="fork", timeout_s=30, what="flaky") == {"ok": 2}
    began = time.monotonic()
    with pytest.raises(UserError, match="dying measurement failed 2 times: a worker exited with status 5"):
        run_workers(_dying_worker, 2, (), start_method="fork", timeout_s=30, what="dying measurement")
    assert time.monotonic() - began < 20  # a dead worker is noticed, not waited for
