"""Cluster description: what one device computes, holds and how fast it talks, per link level.

A cluster has two link levels. Inside a "fast domain" (an NVLink/NVSwitch island: 8 GPUs in a
DGX, 72 in a GB200 NVL72, 1 on a PCIe box whose GPUs talk through the host) devices reach
each other at `intra_bw_gbs`; across domains each device has its own NIC at `inter_bw_gbs`.
Bandwidths are the *achieved* collective bus bandwidth per device (what nccl-tests reports),
not line rate, so the alpha-beta formulas in cost.py use them directly.

Files are TOML or JSON with the field names of `Cluster`; unknown keys are an error that
names the valid ones. `phalanx calibrate` writes one for this machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import UserError
from phalanx.planner.framework_costs import FIELD_NAMES as FRAMEWORK_FIELDS
from phalanx.planner.framework_costs import FrameworkCosts


MAX_DEVICES = 2**20
MAX_DEVICES_WHY = ("the largest training clusters built hold about 10^5 GPUs; a larger count is a typo, "
                   "and the search's work grows with it")
"""The most devices a plan is made for: the bound of every cluster's device count."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """One homogeneous cluster; every figure is per device unless the name says otherwise."""
    name: str = "custom"
    devices_per_node: int = 8
    """Devices in one machine (for display and for CPU sharing; links use fast_domain)."""
    fast_domain: int = 8
    """Devices that share the fast link (NVLink island); 1 when devices only meet over PCIe/network."""
    peak_tflops: float = 989.0
    """Dense bf16 peak of one device, TFLOP/s (the MFU denominator)."""
    fp32_tflops: float = 0.0
    """Dense fp32 peak, TFLOP/s: what a run that computes in fp32 (`Options.fp32_compute`:
    Megatron without --fp16/--bf16) reaches, on CUDA cores (PyTorch leaves TF32 off for
    matmuls since 1.12). 0: not known, such a run priced at `peak_tflops`."""
    fp8_tflops: float = 0.0
    """Dense fp8 tensor-core peak, TFLOP/s (serving plans with fp8 weights); 0: no fp8 units."""
    fp4_tflops: float = 0.0
    """Dense fp4 tensor-core peak, TFLOP/s (serving plans with fp4 weights); 0: no fp4 units."""
    memory_gib: float = 80.0
    """Device memory."""
    memory_reserved_gib: float = 4.0
    """Kept back from planning: runtime context, communication buffers, allocator fragmentation."""
    hbm_tbs: float = 3.35
    """Device memory bandwidth, TB/s: sets the time of memory-bound (element-wise, optimizer) work."""
    hbm_efficiency: float = 0.9
    """Fraction of hbm_tbs that streaming kernels reach. Datasheet bandwidth is not reached: a
    device-to-device copy on an H200 here moved 4.3 of its 4.8 TB/s (0.90). 1.0 where hbm_tbs
    was itself measured (calibrate)."""
    comm_sm_fraction: float = 0.15
    """Fraction of the device's compute a collective takes while it runs hidden behind compute
    (its kernels occupy SMs and memory bandwidth): DeepSeek-V3's report dedicates 20 of an
    H800's 132 SMs to the communication it overlaps (0.15). Each second of hidden communication
    costs this many seconds of compute. 0 on CPUs, where nothing overlaps."""
    elementwise_efficiency: float = 1.0
    """Fraction of the streaming bandwidth (hbm_tbs x hbm_efficiency) a layer's element-wise
    passes (norms, activations, residuals, rotary) reach. 1 on GPUs (fused, streaming kernels);
    calibrate measures it on CPUs from the real Transformer's layer, whose many small ops on
    cache-sized tensors run far below a large add's bandwidth."""
    intra_bw_gbs: float = 370.0
    """Achieved bus bandwidth per device inside the fast domain, GB/s per direction."""
    inter_bw_gbs: float = 47.0
    """Achieved bandwidth of each device's own network link between domains, GB/s per direction."""
    intra_latency_us: float = 3.0
    """Latency of one step of a collective inside the fast domain (the alpha term), microseconds."""
    inter_latency_us: float = 8.0
    """Latency of one step of a collective across domains, microseconds."""
    matmul_efficiency: float = 0.70
    """Fraction of peak a large matrix multiply sustains in training (clocks under power limits)."""
    matmul_half_dim: float = 96.0
    """Matrix dimension at which that efficiency halves: small dims (h/tp, tokens per expert) run slower."""
    sm_count: int = 0
    """Streaming multiprocessors (datasheet): a GEMM's output tiles run in waves of this many,
    and the last wave may leave some idle. 0 (CPUs) means no wave quantization."""
    attention_efficiency: float = 0.50
    """Fraction of peak of fused (flash) attention, forward and backward together."""
    shared_compute: bool = False
    """True for CPUs: peak_tflops is the whole node's, shared by the ranks placed on it."""
    thread_speedup: float = 0.0
    """CPUs: how much faster one process's size-dependent work (FLOPs, element-wise passes)
    runs on all `devices_per_node` threads than on one, measured on a real training step by
    calibrate (small ops do not scale with threads). A rank with fewer processes than cores
    runs cores/world threads at a linear interpolation of that speedup. 0: ideal (cores)."""
    measured_groups: tuple[tuple[int, float, float], ...] = ()
    """(group size, latency us per step, bus GB/s) measured by calibrate; they replace the intra
    figures for groups of that size inside the fast domain (a CPU's collectives slow down as
    more processes share its cores)."""
    host_cpu_slowdown: float = 1.0
    """How much slower the host CPU driving the devices runs a serving engine's per-request
    Python than an x86 server CPU (planner/serve: a step is never shorter than its sequences'
    host work). GB200's Grace: NVIDIA/TransformerEngine issue 2053 times one PyTorch Linear's
    forward at 37.08 us of CPU on a GB200 against 13.48 us on a DGX H100's Xeon 8480C (2.75x). 1: x86."""
    idle_w: float = 0.0
    """Watts one device draws while it waits (a bubble, an exposed collective, a fixed overhead):
    published idle measurements, each preset naming its source. 0: not known (no energy is
    predicted; planner/energy.py)."""
    busy_w: float = 0.0
    """Watts one device draws while it computes: the datasheet's maximum board power (TDP),
    an upper bound of what training draws. 0: not known."""
    min_clock_fraction: float = 0.0
    """The lowest clock a device is run at where it has slack (planner/clocks.py): its base
    clock over its boost clock. 0: clocks are not lowered."""
    announced: bool = False
    """The figures are a vendor's announcement for hardware not yet measured (shown beside
    every plan for this cluster)."""
    framework: FrameworkCosts = FrameworkCosts()
    """What the training framework costs beyond FLOPs, bytes and collectives (measured by
    `phalanx calibrate` on CPUs; none on the GPU presets)."""

    def intra_link(self, size: int) -> tuple[float, float]:
        """(latency us, bus GB/s) of a group of `size` ranks inside one fast domain."""
        for n, latency, bw in self.measured_groups:
            if n == size:
                return latency, bw
        return self.intra_latency_us, self.intra_bw_gbs

    @property
    def hidden_comm_cost(self) -> float:
        """Seconds of compute lost per second of communication hidden behind it (none on a
        CPU, where gloo's collectives run on the computing cores and nothing overlaps)."""
        return 0.0 if self.shared_compute else self.comm_sm_fraction

    def __post_init__(self) -> None:
        problems = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{f.name}={value} must be a finite number")
        for name in ("devices_per_node", "fast_domain"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be at least 1")
            elif getattr(self, name) > MAX_DEVICES:
                problems.append(f"{name}={getattr(self, name)} must be at most {MAX_DEVICES:,} ({MAX_DEVICES_WHY})")
        if self.sm_count < 0:
            problems.append(f"sm_count={self.sm_count} must be 0 (no wave quantization) or positive")
        for name in ("peak_tflops", "memory_gib", "hbm_tbs", "intra_bw_gbs", "inter_bw_gbs",
                     "matmul_efficiency", "attention_efficiency", "hbm_efficiency", "elementwise_efficiency",
                     "host_cpu_slowdown"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if not 0 <= self.min_clock_fraction <= 1:
            problems.append(f"min_clock_fraction={self.min_clock_fraction} must be between 0 (clocks not lowered) and 1")
        for name in ("matmul_efficiency", "attention_efficiency", "hbm_efficiency", "elementwise_efficiency",
                     "comm_sm_fraction"):
            if getattr(self, name) > 1:
                problems.append(f"{name}={getattr(self, name)} is a fraction of peak, at most 1")
        if self.busy_w < self.idle_w:
            problems.append(f"busy_w={self.busy_w} must be at least idle_w={self.idle_w} (a device computing draws "
                            "more than one waiting)")
        for name in ("idle_w", "busy_w", "fp32_tflops", "fp8_tflops", "fp4_tflops", "memory_reserved_gib", "intra_latency_us", "inter_latency_us", "matmul_half_dim",
                     "comm_sm_fraction", "thread_speedup"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must not be negative")
        if self.memory_reserved_gib >= self.memory_gib:
            problems.append(f"memory_reserved_gib={self.memory_reserved_gib} leaves nothing of memory_gib={self.memory_gib}")
        for size, latency, bw in self.measured_groups:
            if size < 1 or not (math.isfinite(latency) and latency >= 0) or not (math.isfinite(bw) and bw > 0):
                problems.append(f"measured_groups row [{size}, {latency}, {bw}] needs a group size of at least 1, "
                                "a latency >= 0 and a bandwidth > 0")
                break
        problems += self.framework.problems()
        if problems:
            raise UserError(f"cluster {self.name!r}: " + "; ".join(problems))

    def check_device_count(self, devices: int) -> None:
        """A job takes whole nodes, or an even share of one (1, 2, 4 of 8): 7 GPUs of an 8-GPU
        node is no allocation a scheduler hands out, and its layouts (pp=7) would not be the
        ones a real job runs. CPUs (shared_compute, `local`) run any count of processes."""
        if devices < 1:
            raise UserError(f"{devices} devices: must be at least 1")
        if devices > MAX_DEVICES:
            raise UserError(f"{devices} devices: at most {MAX_DEVICES:,} ({MAX_DEVICES_WHY})")
        per_node = self.devices_per_node
        if self.shared_compute or self.name == "local" or per_node % devices == 0 or devices % per_node == 0:
            return
        near = sorted({d for d in range(1, per_node + 1) if per_node % d == 0}
                      | {per_node * k for k in (devices // per_node, devices // per_node + 1) if k})
        lower = max((d for d in near if d < devices), default=near[0])
        upper = min(d for d in near if d > devices)
        raise UserError(f"{devices} GPUs on {self.name!r} ({per_node} per node): a GPU count must fill whole "
                        f"nodes or divide one (e.g. {lower} or {upper})")

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - self.memory_reserved_gib) * 2**30

    def peak_flops_per_rank(self, world_size: int) -> float:
        """FLOP/s one rank can reach; on a shared CPU the node's peak splits among all its ranks."""
        if self.shared_compute:
            return self.peak_tflops * 1e12 / world_size * self.thread_scaling(world_size)
        return self.peak_tflops * 1e12

    def compute_flops_per_rank(self, world_size: int, *, fp32: bool) -> float:
        """`peak_flops_per_rank`, or the fp32 peak for a run that computes in fp32 (where known)."""
        if fp32 and self.fp32_tflops and not self.shared_compute:
            return self.fp32_tflops * 1e12
        return self.peak_flops_per_rank(world_size)

    def memory_bw_per_rank(self, world_size: int) -> float:
        """Bytes/s of memory bandwidth one rank gets (shared CPU: split among its ranks)."""
        if self.shared_compute:
            return self.hbm_tbs * 1e12 * self.hbm_efficiency / world_size * self.thread_scaling(world_size)
        return self.hbm_tbs * 1e12 * self.hbm_efficiency

    def thread_scaling(self, world_size: int) -> float:
        """Shared CPU: the fraction of its 1/world share of the node a rank's threads deliver.

        peak_tflops is cores x one thread's rate; a rank of fewer processes than cores runs
        t = cores / world threads at 1 + (t - 1)(thread_speedup - 1)/(cores - 1) times one
        thread's rate, not t times (1 at a rank per core or more, and when not measured).
        """
        cores = self.devices_per_node
        if not self.shared_compute or self.thread_speedup <= 0 or world_size >= cores or cores <= 1:
            return 1.0
        threads = cores / world_size
        rate = 1 + (threads - 1) * (self.thread_speedup - 1) / (cores - 1)
        return rate / threads

    def queueing(self, world_size: int) -> float:
        return max(1.0, world_size / self.devices_per_node) if self.shared_compute else 1.0


# Power (idle_w, busy_w), one figure per GPU, the GPU board alone (no CPUs, NICs, switches,
# fans or cooling: planner/energy.py says why). busy_w is the datasheet's maximum board power
# (TDP), the most a device draws while it computes. idle_w: the one published idle reading
# found is an H200 SXM's 80 W against 593 W under load (the Alice "GPU Energy Benchmark",
# 2026: NVML readings of an idle H200 with its context open), 0.114 of its 700 W TDP; for the
# other GPUs no published idle figure was found, so idle_w is that same share of each TDP
# (rounded). A rank waiting inside a step (a bubble, an exposed collective) keeps its clocks up
# and polls, so it draws more than idle: the prediction's waiting energy is a floor.
IDLE_SHARE_OF_TDP = 80.0 / 700.0
"""The H200's published idle draw over its TDP, applied to GPUs with no idle figure of their own."""


GRACE_HOST_SLOWDOWN = 37.08 / 13.48
"""A GB200's Grace CPU against a DGX H100's Xeon Platinum 8480C on the same PyTorch host work
(torch.nn.Linear's forward, hidden 2048, 8192 tokens, bf16: 37.08 us against 13.48 us of CPU
per call; NVIDIA/TransformerEngine issue 2053's table)."""


def _idle(tdp_w: float) -> float:
    return float(round(IDLE_SHARE_OF_TDP * tdp_w))


# The lowest clock planner/clocks.py lowers a device with slack to: the base clock over the
# boost clock, the range the vendor specifies for sustained operation under TDP. A100 SXM4:
# boost 1,410 MHz (NVIDIA A100 Tensor Core GPU architecture whitepaper), base 1,275 MHz; H100
# SXM5 (and H800, the same board): boost 1,980 MHz, base 1,590 MHz; base clocks and the H100's
# boost as TechPowerUp's GPU database lists them (NVIDIA's datasheets give neither). The other
# presets keep 0 (clocks not lowered): no base clock for them was checked here.
A100_SXM_CLOCKS = 1275.0 / 1410.0
H100_SXM_CLOCKS = 1590.0 / 1980.0


# Presets. Link figures are the measured ones of published-figures.md section 2; peak and
# memory are the vendors' datasheet values (fp8/fp4 peaks dense, i.e. half the sheets'
# "with sparsity" figures, as published-figures.md section 5 lists them). The efficiency fields keep their defaults (one
# set for every GPU, see docs/planner.md) so that no preset is tuned to a published run.
PRESETS: dict[str, Cluster] = {
    c.name: c
    for c in [
        # DGX A100 80GB: NVLink3 + NVSwitch (229 GB/s all-reduce bus bw), 8x HDR 200 Gb/s (24 GB/s).
        # Power: A100 SXM 80GB 400 W max TDP (NVIDIA A100 Tensor Core GPU datasheet).
        Cluster(name="dgx-a100", peak_tflops=312.0, sm_count=108, memory_gib=80.0, hbm_tbs=2.04,
                intra_bw_gbs=229.0, inter_bw_gbs=24.0, busy_w=400.0, idle_w=_idle(400.0),
                min_clock_fraction=A100_SXM_CLOCKS),
        # DGX H100: NVLink4 (about 370 GB/s effective), 8x NDR 400 Gb/s (46-48 GB/s).
        # FP8 1,979 dense (NVIDIA H100 Tensor Core GPU datasheet, SXM: 3,958 with sparsity); no fp4.
        # Power: H100 SXM up to 700 W (configurable) max TDP (same datasheet).
        Cluster(name="dgx-h100", peak_tflops=989.0, fp8_tflops=1979.0, sm_count=132, memory_gib=80.0, hbm_tbs=3.35,
                intra_bw_gbs=370.0, inter_bw_gbs=47.0, busy_w=700.0, idle_w=_idle(700.0),
                min_clock_fraction=H100_SXM_CLOCKS),
        # DGX H200: same NVLink4 (about 475 GB/s all-reduce bus bw measured), 141 GB HBM3e.
        # Device figures from NVIDIA's H200 Tensor Core GPU datasheet (H200 SXM): 989 TFLOP/s
        # dense BF16 (the sheet's 1,979 counts 2:4 sparsity), 141 GB HBM3e at 4.8 TB/s; the
        # H100's Hopper die, so its 132 SMs (shared/reference/published-figures.md, "Hardware").
        # Power: H200 SXM up to 700 W max TDP (same datasheet); idle 80 W measured (see above).
        Cluster(name="dgx-h200", peak_tflops=989.0, fp8_tflops=1979.0, sm_count=132, memory_gib=141.0, hbm_tbs=4.8,
                intra_bw_gbs=475.0, inter_bw_gbs=47.0, busy_w=700.0, idle_w=80.0),
        # GB200 NVL72: 72 GPUs in one NVLink domain (835-847 GB/s at 4-8 GiB), 400 Gb/s NIC each.
        # GB200 NVL72 datasheet per GPU, dense: BF16 2.5 PF, FP8 5, FP4 10 (published-figures.md section 5).
        Cluster(name="gb200-nvl72", devices_per_node=4, fast_domain=72, peak_tflops=2500.0, fp8_tflops=5000.0,
                fp4_tflops=10000.0, sm_count=148, host_cpu_slowdown=GRACE_HOST_SLOWDOWN,
                memory_gib=186.0, hbm_tbs=8.0, intra_bw_gbs=840.0, inter_bw_gbs=47.0,
                # Power: a liquid-cooled Blackwell GPU runs up to 1,200 W (NVIDIA, GTC 2024); a GB200
                # superchip (one Grace, two GPUs) is configurable up to 2,700 W, the Grace CPU and its
                # memory being the rest. The GPU's share only; the Grace CPUs are node overhead.
                busy_w=1200.0, idle_w=_idle(1200.0)),
        # DGX B200 datasheet: 8 B200, 1,440 GB HBM3e (180 GB each), 64 TB/s HBM (8 TB/s each),
        # 72 PF FP8 training and 144 PF FP4 inference per system with sparsity, so per GPU dense
        # BF16 2.25 PF, FP8 4.5, FP4 9 (published-figures.md section 5); 148 SMs (Blackwell die).
        # NVLink 5 (900 GB/s per direction): the bus bandwidth measured on GB200's NVLink 5
        # (840 GB/s) for want of a published 8-GPU figure; 8x ConnectX-7 400 Gb/s as the DGX H100.
        # Power: B200 in HGX/DGX B200 (air-cooled) up to 1,000 W max TDP (NVIDIA HGX B200 specifications).
        Cluster(name="dgx-b200", peak_tflops=2250.0, fp8_tflops=4500.0, fp4_tflops=9000.0, sm_count=148,
                memory_gib=180.0, hbm_tbs=8.0, intra_bw_gbs=840.0, inter_bw_gbs=47.0, busy_w=1000.0,
                idle_w=_idle(1000.0)),
        # 8x H100 PCIe without NVLink bridges: every collective goes through PCIe Gen5 x16
        # (about 28 GB/s all-reduce bus bw measured on such boxes), so the fast domain is 1.
        Cluster(name="pcie-h100", fast_domain=1, peak_tflops=756.0, fp8_tflops=1513.0, sm_count=114, memory_gib=80.0, hbm_tbs=2.0,
                intra_bw_gbs=28.0, inter_bw_gbs=28.0, inter_latency_us=5.0,
                # Power: H100 PCIe 350 W max TDP (NVIDIA H100 datasheet, PCIe: 300-350 W configurable).
                busy_w=350.0, idle_w=_idle(350.0)),
        # H800 (DeepSeek-V3 report: NVLink about 160 GB/s, IB 50 GB/s per GPU): same core as H100.
        # Power: the H100 SXM's board, 700 W max TDP.
        Cluster(name="hgx-h800", peak_tflops=989.0, fp8_tflops=1979.0, sm_count=132, memory_gib=80.0, hbm_tbs=3.35,
                intra_bw_gbs=160.0, inter_bw_gbs=47.0, busy_w=700.0, idle_w=_idle(700.0),
                min_clock_fraction=H100_SXM_CLOCKS),
        # Vera Rubin NVL72: ANNOUNCED, NOT MEASURED (NVIDIA, GTC 2025 as "NVL144", counting dies,
        # and CES 2026 as NVL72, counting packages); every figure will move when it ships.
        # Per GPU: 288 GB HBM4 at 22 TB/s; NVFP4 35 PF for training (50 PF inference with its
        # adaptive compression), so fp4_tflops=35,000. FP8: the rack's 1.2 EF of FP8 training
        # over 72 GPUs, 16.7 PF (3.3x the GB300 NVL72's dense 360 PF, so dense). BF16: NVIDIA
        # has announced none; half the FP8 rate, as on every generation before. NVLink 6:
        # 3.6 TB/s per GPU both ways, twice NVLink 5, so twice GB200's measured bus bandwidth;
        # ConnectX-9 1.6 Tb/s per GPU at the 47/50 of line rate CX-7 reaches. SMs unannounced:
        # 0 (no wave quantization). Power: about 1,800 W per GPU, as reported by the press, not a
        # datasheet; idle the H200's share of it. 4 GPUs per compute tray, 72 in the NVLink domain.
        Cluster(name="rubin-nvl72", devices_per_node=4, fast_domain=72, peak_tflops=8333.0, fp8_tflops=16667.0,
                fp4_tflops=35000.0, memory_gib=288.0, hbm_tbs=22.0, intra_bw_gbs=1680.0, inter_bw_gbs=188.0,
                busy_w=1800.0, idle_w=_idle(1800.0), announced=True),
        # This machine before `phalanx calibrate` has measured it: a rough CPU guess.
        Cluster(name="local", devices_per_node=os.cpu_count() or 1, fast_domain=os.cpu_count() or 1,
                peak_tflops=0.1, memory_gib=8.0, memory_reserved_gib=1.0, hbm_tbs=0.02, hbm_efficiency=1.0,
                intra_bw_gbs=2.0, inter_bw_gbs=2.0, intra_latency_us=50.0, inter_latency_us=50.0,
                matmul_efficiency=1.0, matmul_half_dim=32.0, attention_efficiency=0.5,
                framework=FrameworkCosts(layer_overhead_us=300.0), shared_compute=True, comm_sm_fraction=0.0),
    ]
}

_FIELDS = {f.name: f for f in (*dataclasses.fields(Cluster), *dataclasses.fields(FrameworkCosts))
           if f.name != "framework"}
"""A cluster file's keys: the hardware's and the framework costs', side by side."""


def cluster_to_dict(cluster: Cluster) -> dict:
    """The flat table a cluster file holds (what `cluster_from_dict` reads back)."""
    out = dataclasses.asdict(cluster)
    out.update(out.pop("framework"))
    return out


def local_cluster_path() -> Path:
    """Where `phalanx calibrate` writes, and `--cluster local` reads, this machine's figures."""
    root = os.environ.get("PHALANX_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "phalanx")
    return Path(root) / "cluster-local.json"


def cluster_from_dict(data: dict, *, source: str) -> Cluster:
    """Build a Cluster from parsed file contents, rejecting unknown keys and bad types."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a table of cluster fields, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise UserError(f"{source}: unknown cluster key {unknown[0]!r}; valid keys: {', '.join(_FIELDS)}")
    values = {}
    for key, raw in data.items():
        kind = type(_FIELDS[key].default)
        if kind is bool:
            if not isinstance(raw, bool):
                raise UserError(f"{source}: {key} must be true or false, got {raw!r}")
            values[key] = raw
        elif kind is int:
            if isinstance(raw, bool) or not isinstance(raw, int):
                raise UserError(f"{source}: {key} must be an integer, got {raw!r}")
            values[key] = raw
        elif key == "measured_groups":
            try:
                values[key] = tuple((int(n), float(lat), float(bw)) for n, lat, bw in raw)
            except (TypeError, ValueError):
                raise UserError(f"{source}: measured_groups must be a list of [size, latency_us, bus_gbs]") from None
        elif key == "fsdp_pp_overhead_groups":
            try:
                values[key] = tuple((int(n), float(a), float(b)) for n, a, b in raw)
            except (TypeError, ValueError):
                raise UserError(f"{source}: {key} must be a list of [processes, us per step, us per micro-batch]") from None
        elif key in ("ddp_step_overhead_ms", "fsdp_unit_overhead_groups"):
            try:
                values[key] = tuple((int(n), float(x)) for n, x in raw)
            except (TypeError, ValueError):
                unit = "ms" if key == "ddp_step_overhead_ms" else "us"
                raise UserError(f"{source}: {key} must be a list of [processes, {unit}]") from None
        elif key == "pp_action_overhead_us":
            try:
                values[key] = tuple((str(s), float(us)) for s, us in raw)
            except (TypeError, ValueError):
                raise UserError(f"{source}: pp_action_overhead_us must be a list of [schedule, us]") from None
        elif kind is float:
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                raise UserError(f"{source}: {key} must be a number, got {raw!r}")
            values[key] = float(raw)
        else:
            values[key] = str(raw)
    values.setdefault("name", Path(source).stem)
    if "measured_groups" in values:  # written by calibrate, before hbm_efficiency existed: measured bandwidth
        values.setdefault("hbm_efficiency", 1.0)
    framework = FrameworkCosts(**{k: values.pop(k) for k in FRAMEWORK_FIELDS if k in values})
    return Cluster(framework=framework, **values)


def load_cluster_file(path: str | Path) -> Cluster:
    """Read a .toml or .json cluster file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read cluster file {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"cluster file {str(path)!r} is not text (a binary file?); expected TOML or JSON") from None
    try:
        if path.suffix.lower() == ".toml":
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cluster file {str(path)!r} is not valid {path.suffix[1:].upper() or 'JSON'}: {exc}") from None
    if not data:  # every field would be a default: a plan for a machine nobody described
        raise UserError(f"cluster file {str(path)!r} is empty; it gives Cluster's fields (name, peak_tflops, memory_gib, ...)")
    return cluster_from_dict(data, source=str(path))


GPU_PRESETS = (("GB200", "gb200-nvl72"), ("B200", "dgx-b200"), ("H800", "hgx-h800"), ("H200", "dgx-h200"), ("H100", "dgx-h100"),
               ("A100", "dgx-a100"))
"""A GPU's name (as CUDA reports it) -> the preset of the machines it comes in."""


def this_machine(gpu_name: str = "") -> str:
    """The cluster `--plan auto` plans for when none is named: this machine's calibration if
    there is one; else, on a GPU, the preset of its kind (a datasheet beats the CPU guess);
    else `local`."""
    if local_cluster_path().exists() or not gpu_name:
        return "local"
    upper = gpu_name.upper()
    if "PCIE" in upper and "H100" in upper:
        return "pcie-h100"
    return next((preset for key, preset in GPU_PRESETS if key in upper), "local")


def cluster_from_name(name: str) -> Cluster:
    """A preset, `local` (the calibrated file if there is one), or a path to a file."""
    if name == "local" and local_cluster_path().exists():
        return load_cluster_file(local_cluster_path())
    if name in PRESETS:
        return PRESETS[name]
    if os.path.sep in name or name.endswith((".toml", ".json")):
        return load_cluster_file(name)
    raise UserError(f"unknown cluster {name!r}; choose a file or one of: {', '.join(PRESETS)}")
