"""What a serving engine costs per step beyond FLOPs, bytes and collectives, and where the
figures come from.

On this CPU they are measured: `phalanx calibrate --serve` times `phalanx serve`'s own engine
on a small model at a few batch sizes and contexts, fits these constants (planner/
serve/fit.py) together with the CPU's effective FLOP rate and bandwidth, and writes them to
`serve-local.json` beside the training calibration (`--cluster local` then reads it). On the
GPU presets they are what the engines whose published runs the validation uses (TensorRT-LLM,
SGLang) spend beyond the GPU's work, which their own documents put at nothing while the GPU's
step is the longer: launches and Python per layer are captured in CUDA graphs (the
perf-overview runs' `cuda_graph_config`, SGLang's decode), and the host's scheduling, sampling
and bookkeeping of step n run while the GPU computes step n + 1 (TensorRT-LLM's overlap
scheduler, on by default; SGLang v0.4's zero-overhead scheduler, whose Nsight profile of five
consecutive decode batches shows no idle time on the GPU). A host slower than the GPU's step
(a small model at a batch of thousands) then sets the step instead; that per-sequence host
time is not modelled (no engine profile at such batches was found): docs/serve_planner.md,
"Validation".
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import UserError
from phalanx.planner.hardware import Cluster, local_cluster_path


@dataclass(frozen=True, kw_only=True)
class ServeCosts:
    """Framework seconds of one engine step on one rank, by what they grow with."""
    step_s: float = 0.0
    """Per step: scheduling the batch, sampling, detokenizing, the step's host launch."""
    layer_s: float = 0.0
    """Per layer per step: kernel launches and Python (0 under CUDA graphs)."""
    sequence_s: float = 0.0
    """Per sequence per step: its sampling, block table and token bookkeeping."""
    sequence_layer_s: float = 0.0
    """Per decoding sequence per layer: phalanx's paged cache gathers each sequence's keys
    and values into a new tensor per layer (docs/serve.md, "Not there yet")."""
    token_s: float = 0.0
    """Per token fed per step beyond its FLOPs and bytes (element-wise passes, copies)."""
    gemm_s: float = 0.0
    """Per GEMM launched per step (one per weight shape per layer, a grouped GEMM once): the
    time a memory-bound GEMM takes beyond its bytes at the cluster's streaming bandwidth, its
    pipeline's fill and drain (`GPU_KERNEL_FILL_S`); 0 on this CPU, where calibration's
    per-layer cost holds it."""
    gemm_fp4_s: float = 0.0
    """`gemm_s` for a GEMM of NVFP4 weights and activations, whose block-scaled kernels take
    longer to fill and drain (`GPU_FP4_FILL_S`); 0: `gemm_s`."""
    host_sequence_s: float = 0.0
    """Per sequence per step, host work an overlapping engine runs beside the GPU's step
    (sampling's bookkeeping, each request's token appended in Python): TensorRT-LLM's overlap
    scheduler and SGLang's zero-overhead scheduler prepare step n + 1 while the GPU runs step n,
    so a step lasts the longer of the GPU's work and this times its sequences (times the
    cluster's `host_cpu_slowdown`), not their sum (`TORCH_SAMPLER_HOST_S`)."""
    request_s: float = 0.0
    """Per request, on its way to the first token beyond the steps: HTTP parsing, tokenizing,
    the engine thread taking it in, the first streamed chunk back (measured through the server)."""
    group_step_s: tuple[tuple[int, float], ...] = ()
    """(tp ranks, seconds) per forward a tp group adds beyond its all-reduces' alpha-beta time:
    on this CPU mostly DTensor's dispatch of every op of the sharded model on every rank (a
    profile of a tp=2 decode step: the sharded linears and their redistributions, each forward,
    took many times what one process spends on the whole step), then rank 0 broadcasting each step's forwards, the gathered logits, and every
    collective waiting for all its ranks to be scheduled on shared cores (measured through the
    server)."""
    split_forwards: bool = False
    """The engine runs a step's decodes and its prompt chunks as two forwards (`phalanx serve`:
    serve/input_batch.step_forwards), so a step holding both pays every per-forward cost twice:
    reading the weights, the all-reduces, the group's cost per forward (timed on this CPU: such
    a step took about the sum of the two alone, at one process and at tp=2). The GPU engines
    whose published runs the presets are checked on batch both into one forward."""
    elementwise_passes: bool = False
    """Charge the step's element-wise passes (norms, activations, residual adds, rotary, the
    activations' quantization and the MoE's permutes) as their own memory-bound kernels:
    reading and writing the layer's activations once at the cluster's streaming bandwidth, the
    training planner's forward term (stage_time.layer_cost: `layer_activation_bytes`, the
    published Korthikanti et al. count). On GPUs (`GPU_ENGINE`, `GPU_CPP_EXECUTOR`); off on this
    CPU, where calibration's per-token cost (`token_s`) holds them."""
    flops_scale: float = 1.0
    """Measured GEMM rate over the cluster's `peak_tflops x matmul_efficiency` (CPU fit; 1 on GPUs)."""
    bandwidth_scale: float = 1.0
    """Measured weight-streaming rate over the cluster's bandwidth (CPU fit; 1 on GPUs)."""

    def gemm_fill(self, weight_dtype: str) -> float:
        """Seconds one GEMM launch fills and drains, by the weights' dtype."""
        return self.gemm_fp4_s if weight_dtype == "fp4" and self.gemm_fp4_s else self.gemm_s

    def group_step(self, tp: int) -> float:
        return next((sec for size, sec in self.group_step_s if size == tp), 0.0)

    def problems(self) -> list[str]:
        out = []
        for size, sec in self.group_step_s:
            if size < 2 or not sec >= 0:
                out.append(f"group_step_s row [{size}, {sec}] needs a group of >= 2 ranks and seconds >= 0")
        for f in dataclasses.fields(self):
            if f.name in ("group_step_s", "split_forwards", "elementwise_passes"):
                continue
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and value >= 0 and value == value and value != float("inf")):
                out.append(f"{f.name}={value!r} must be a finite number >= 0")
        for name in ("flops_scale", "bandwidth_scale"):
            if isinstance(getattr(self, name), (int, float)) and not getattr(self, name) > 0:
                out.append(f"{name} must be positive")
        return out


DEEPGEMM_DECODE_GEMMS = ((64, 2112, 7168, 206.0), (64, 24576, 1536, 289.0), (64, 32768, 512, 219.0),
                         (64, 7168, 16384, 336.0), (64, 4096, 7168, 287.0), (64, 7168, 2048, 295.0),
                         (128, 2112, 7168, 352.0), (128, 24576, 1536, 535.0), (128, 32768, 512, 358.0),
                         (128, 7168, 16384, 645.0), (128, 4096, 7168, 533.0), (128, 7168, 2048, 510.0))
"""(M, N, K, TFLOP/s) of DeepGEMM's published fp8 GEMMs at decode sizes (every row of M = 64
and 128 of its README's "Normal GEMMs for dense models" table, deepseek-ai/DeepGEMM@7a70b43,
measured on an H800 whose HBM gives 3.35 TB/s): memory-bound, yet each moved its bytes (M x K
and N x K fp8 in, M x N bf16 out; the table's GB/s) at 0.45 to 0.80 of that bandwidth."""
H800_STREAM_BYTES_PER_S = 3.35e12 * 0.9
"""The H800's HBM (3.35 TB/s) at the presets' streaming fraction (hardware.Cluster.hbm_efficiency)."""


def kernel_fill_seconds() -> list[float]:
    """Each DeepGEMM decode-size GEMM's time (2 M N K / its TFLOP/s) beyond its bytes at the
    streaming bandwidth."""
    out = []
    for m, n, k, tflops in DEEPGEMM_DECODE_GEMMS:
        nbytes = m * k + n * k + 2 * m * n
        out.append(2 * m * n * k / (tflops * 1e12) - nbytes / H800_STREAM_BYTES_PER_S)
    return out


GPU_KERNEL_FILL_S = statistics.median(kernel_fill_seconds())
"""A GEMM's fill and drain on a GPU: the median of `kernel_fill_seconds()` (3.5 us)."""

CUBLASLT_FP4_DECODE_GEMMS = ((128, 2048, 7168, 338.0), (128, 24576, 1536, 745.0), (512, 2048, 7168, 1422.0),
                             (512, 7168, 2048, 1190.0))
"""(M, N, K, TFLOP/s) of cuBLASLt's FP4 x FP4 GEMMs of 128 and 512 rows on a B200 (the cublasTest
13.3 column of deepseek-ai/DeepGEMM pull request 348's table; MXFP4, 32-value block scales,
the nearest published kin of NVFP4's 16-value ones): every row of fewer than 1,024 rows. The
same shapes in fp8 stream near the bandwidth after 2.3 to 3.3 us (vLLM pull request 18778's
B200 GEMMs, `benchmarks/serve_planner_published.py --kernels`); these take 9 to 10 us beyond
their bytes, as FlashInfer issue 1732 found an NVFP4 GEMM of one row streaming 1.78 of B200's
8 TB/s."""
B200_STREAM_BYTES_PER_S = 8e12 * 0.9
"""B200's HBM (8 TB/s) at the presets' streaming fraction."""
FP4_BYTES = 0.5 + 1 / 16


def fp4_fill_seconds() -> list[float]:
    """Each cuBLASLt FP4 GEMM's time beyond its bytes (weights and inputs in fp4 with their
    scales, bf16 outputs) at B200's streaming bandwidth."""
    out = []
    for m, n, k, tflops in CUBLASLT_FP4_DECODE_GEMMS:
        nbytes = (n * k + m * k) * FP4_BYTES + 2 * m * n
        out.append(2 * m * n * k / (tflops * 1e12) - nbytes / B200_STREAM_BYTES_PER_S)
    return out


GPU_FP4_FILL_S = statistics.median(fp4_fill_seconds())
"""An NVFP4 GEMM's fill and drain on a GPU: the median of `fp4_fill_seconds()` (9.5 us)."""

TORCH_SAMPLER_HOST_S = 11.3e-3 / 1000
"""Host seconds per sequence per step of TensorRT-LLM's PyTorch-backend sampler (TorchSampler),
as its maintainers measured it: NVIDIA/TensorRT-LLM pull request 11983 (2026-03) gives "sampling
related host overhead" of 11.3 ms per step at a batch of 1,000 (Llama-3.2-1B on an L40S's x86
host, 13.8 ms before that change; the C++ TRTLLMSampler 5.9 ms). Only the sampler's share of
the executor's per-request Python (scheduling, input preparation and response handling are
not in it), and measured on a later, already faster sampler than v1.0's (pull requests 7908
and 11141 sped it up in between): a floor of the host's time per sequence, not a fit."""

GPU_ENGINE = ServeCosts(gemm_s=GPU_KERNEL_FILL_S, gemm_fp4_s=GPU_FP4_FILL_S, host_sequence_s=TORCH_SAMPLER_HOST_S,
                        elementwise_passes=True)
"""A Python-driven engine on a GPU (TensorRT-LLM's PyTorch backend, SGLang, vLLM): no framework
time beyond the GPU's while the GPU's step is the longer (CUDA graphs; the host's work
overlapped with the GPU's step, module docstring), each GEMM's fill and drain as DeepGEMM's
published decode-size GEMMs show it, and a step never shorter than its sequences' host work
(`TORCH_SAMPLER_HOST_S`, TensorRT-LLM's, the one engine whose figure was found). Issue 23
charged 2 ms of host work per step instead, a figure set on the visible published rows, not
measured: issue 39 took it out."""

GPU_CPP_EXECUTOR = ServeCosts(gemm_s=GPU_KERNEL_FILL_S, gemm_fp4_s=GPU_FP4_FILL_S, elementwise_passes=True)
"""TensorRT-LLM's TensorRT engines under its C++ executor (v0.17 and before): no Python per
request; its host time per sequence is not published, so none is charged."""

CPU_GUESS = ServeCosts(step_s=2e-3, layer_s=3e-4, sequence_s=2e-4, sequence_layer_s=1e-4, split_forwards=True)
"""`phalanx serve` on a CPU before `phalanx calibrate --serve` has measured it: rough."""


def serve_costs_path() -> Path:
    """`serve-local.json`, beside the cluster file `phalanx calibrate` writes."""
    return local_cluster_path().with_name("serve-local.json")


def load_serve_costs(path: Path) -> ServeCosts:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read serving calibration {str(path)!r}: {exc}") from None
    fields = {f.name for f in dataclasses.fields(ServeCosts)}
    unknown = sorted(set(data) - fields - {"source"})
    if unknown:
        raise UserError(f"{path}: unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(fields))}")
    values = {k: v for k, v in data.items() if k in fields}
    try:
        values["group_step_s"] = tuple((int(n), float(sec)) for n, sec in values.get("group_step_s", ()))
    except (TypeError, ValueError):
        raise UserError(f"{path}: group_step_s must be a list of [tp ranks, seconds]") from None
    for name in ("split_forwards", "elementwise_passes"):
        if not isinstance(values.get(name, False), bool):
            raise UserError(f"{path}: {name} must be true or false")
    costs = ServeCosts(**values)
    if costs.problems():
        raise UserError(f"{path}: " + "; ".join(costs.problems()))
    return costs


def serve_costs_for(cluster: Cluster) -> ServeCosts:
    """The engine costs a plan on `cluster` assumes: this CPU's measured ones (or the guess),
    or the GPU engines'."""
    if not cluster.shared_compute:
        return GPU_ENGINE
    path = serve_costs_path()
    return load_serve_costs(path) if path.exists() else CPU_GUESS
