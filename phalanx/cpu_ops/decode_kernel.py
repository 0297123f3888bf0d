"""Decode attention on the CPU read straight from the paged pool: a small C kernel
(`cpu_ops/decode_kernel.c`), built with the machine's C compiler on first use and loaded by ctypes.

Why: a decode step otherwise gathers each group's key and value rows into a new tensor and the
flash kernel reads them again, and `scaled_dot_product_attention`'s CPU kernel packs them once
more for products of one or two query rows. The kernel reads each sequence's rows once, where
they lie, whole half-rows with the next ones prefetched, and needs no padding or grouping:
`benchmarks/decode_attention_kernels.py` measured it against gather + flash on serve_load's
shapes and pool sizes. A `torch.compile`d kernel that read the pool in place was tried first and
was slower than gather + flash: inductor's loops took the values a cache line at a time over
every key.

Built once per machine into `$PHALANX_CACHE_DIR` (else `$XDG_CACHE_HOME/phalanx`, else
`~/.cache/phalanx`), keyed by the source, the compiler and the CPU's flags (`-march=native`),
in a fraction of a second. Float32 or bfloat16 pools (a bfloat16 key or value is widened as it
is read; the products, softmax and output are float32's, the output then cast back to the
query's dtype, as SDPA's CPU kernel accumulates bfloat16 in float32). If no compiler works, a warning says so once and
decodes gather (`paged_attention.py`); `PHALANX_CPU_DECODE_KERNEL=0` does the same on purpose.
The library's OpenMP calls bind to the libgomp torch already loaded, so it runs on torch's
threads, as many as `torch.get_num_threads()`, not on a second pool competing for the cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_kernel.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
LIBS = ["-lm"]  # expf; after the source, where the linker still wants it
ON = os.environ.get("PHALANX_CPU_DECODE_KERNEL", "1") != "0"
"""Whether CPU decodes may use the kernel (benchmarks and tests switch it)."""

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The pools' dtypes the kernel reads."""

_functions: dict | None = None
"""torch dtype -> the kernel's function for a pool of that dtype."""
_failure: str | None = None


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decodes on this device and dtype read the pool through the kernel (building it
    now if need be)."""
    return ON and torch.device(device).type == "cpu" and dtype in KERNEL_DTYPES and _load() is not None


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, first: torch.Tensor,
           end: torch.Tensor, most: int, scale: float) -> torch.Tensor:
    """q (n, kv_heads, group, head_dim); k_pool (pool slots, kv_heads, head_dim) and v_pool
    (pool slots, kv_heads, channels): views of one pool whose rows are `stride(0)` apart, each
    row's heads contiguous; slots (n, positions) int64, contiguous; sequence s sees the keys at
    slots[s, first[s]:end[s]] (first and end contiguous int64), `most` the largest such count
    (the caller works these out once for every layer of a step) -> (n, kv_heads, group,
    channels), in q's dtype (computed in float32)."""
    n, kv_heads, group, dim = q.shape
    channels = v_pool.shape[-1]
    if k_pool.stride(0) != v_pool.stride(0) or k_pool.stride()[1:] != (dim, 1) or v_pool.stride()[1:] != (channels, 1):
        raise ValueError(f"k_pool and v_pool need one row stride and contiguous heads, got strides "
                         f"{k_pool.stride()} and {v_pool.stride()}")
    if k_pool.dtype != v_pool.dtype or k_pool.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the kernel reads float32 or bfloat16 pools, got {k_pool.dtype} and {v_pool.dtype}")
    wide = q.to(torch.float32).contiguous()
    scratch = torch.empty(n, kv_heads * group, most)
    out = torch.empty(n, kv_heads, group, channels)
    _load()[k_pool.dtype](wide.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), k_pool.stride(0), slots.data_ptr(), slots.stride(0),
            first.data_ptr(), end.data_ptr(), n, kv_heads, group, dim, channels, scale, scratch.data_ptr(), most,
            out.data_ptr(), torch.get_num_threads())
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _load() -> dict | None:
    """The kernel's functions by pool dtype, built and loaded once per process; None if that failed."""
    global _functions, _failure
    if _functions is None and _failure is None:
        try:
            library = ctypes.CDLL(str(_build()))
            _functions = {torch.float32: _bind(library.phalanx_decode_attention),
                          torch.bfloat16: _bind(library.phalanx_decode_attention_bf16)}
        except (OSError, subprocess.SubprocessError, RuntimeError) as error:
            _failure = str(error)
            print(f"phalanx: the CPU decode-attention kernel is not available ({_failure}); decodes gather "
                  "their keys instead (slower)", file=sys.stderr, flush=True)
    return _functions


def _bind(function):
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, pointer, pointer, integer, pointer, integer, pointer, pointer, integer, integer,
                         integer, integer, integer, ctypes.c_float, pointer, integer, pointer, ctypes.c_int]
    function.restype = None
    return function


def _build() -> Path:
    """The shared library for this source, compiler and CPU, compiled if not cached yet."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS + LIBS), platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    folder = _cache_dir() / "kernels"
    target = folder / f"cpu_decode_kernel-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:  # then renamed: concurrent builds never see half a file
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), *LIBS, "-o", str(built)], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {(result.stderr or result.stdout).strip()[-500:]}")
        os.replace(built, target)
    return target


def _cache_dir() -> Path:
    if os.environ.get("PHALANX_CACHE_DIR"):
        return Path(os.environ["PHALANX_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "phalanx"


def _cpu_flags() -> str:
    """What `-march=native` compiled for: a library built on another CPU may not run here."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()
