"""This rank's model for serving, and how many KV blocks fit.

The model is loaded as `phalanx generate` loads it (`generate.model_source.load_model`: each
rank reads only its slices), then cast to `--dtype`; on CPU its plain matrices then multiply
through oneDNN (`cpu_ops/onednn_linear.py`). The block pool is `--num-kv-blocks`, or
what `--kv-cache-memory` GiB holds (every layer's keys and values of this rank's kv heads, or
latent attention's latent and rotated key: `paged_cache.kv_channels_per_position`; with the
multi-token-prediction draft one layer more, `mtp_draft.py`), by
default 1 GiB on CPU and 90% of the device memory left after the weights on a GPU, but never
more than `--max-num-seqs` sequences of the model's whole context need.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx.cpu_ops.onednn_linear import use_onednn
from phalanx.errors import UserError
from phalanx.inference.model_source import load_model
from phalanx.parallel.tp_inference import localize_block_matrices
from phalanx.serve.job import ServeJob
from phalanx.serve.paged_cache import bytes_per_block, kv_channels_per_position

GIB = 1 << 30
CPU_DEFAULT_KV_GIB = 1.0
GPU_MEMORY_FRACTION = 0.9


def pick_dtype(name: str, device):
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def load_serving_model(source, mesh, dtype, expert_slots: dict | None = None):
    """Under attention data parallelism (dp > 1) every rank keeps its replica of the dense
    weights as loaded: the DDP wrapper `parallelize` puts around a dp model for training (it
    would broadcast buffers before every forward) is taken off. Under tp the blocks' matrices
    become their local shards (`parallel.tp_inference`: no DTensor dispatch per step)."""
    model = load_model(source, mesh, expert_slots)
    if isinstance(model, DistributedDataParallel):
        model = model.module
    model = model.to(dtype).eval()
    if mesh.plan.tp > 1:
        localize_block_matrices(model, mesh.group("tp"))
    use_onednn(model)  # on CPU: oneDNN's GEMM for the plain matrices (cpu_ops/onednn_linear.py)
    return model


def kv_blocks(job: ServeJob, cfg, tp: int, device, dtype, agree: bool = False) -> int:
    """The size of the block pool (see the module docstring). `agree`: every rank takes the
    smallest over the ranks (free GPU memory differs), since all index the same blocks."""
    blocks = _kv_blocks(job, cfg, tp, device, dtype)
    if agree:

        count = torch.tensor([blocks], device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        blocks = int(count)
    return blocks


def _kv_blocks(job: ServeJob, cfg, tp: int, device, dtype) -> int:
    draft_layers = 1 if job.speculative is not None and job.speculative.drafts_with_model else 0  # mtp_draft.py
    per_block = bytes_per_block(job.block_size, cfg.n_layers + draft_layers, kv_channels_per_position(cfg, tp),
                                torch.empty((), dtype=dtype).element_size())
    if job.num_kv_blocks:
        held = _device_memory(device)
        if job.num_kv_blocks * per_block > held:
            raise UserError(f"--num-kv-blocks {job.num_kv_blocks} of {per_block:,} bytes need "
                            f"{job.num_kv_blocks * per_block / GIB:,.1f} GiB; this {device.type} device has "
                            f"{held / GIB:,.1f} GiB")
        return job.num_kv_blocks
    if job.kv_cache_memory:
        budget = job.kv_cache_memory * GIB
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * GPU_MEMORY_FRACTION
    else:
        budget = CPU_DEFAULT_KV_GIB * GIB
    blocks = int(budget // per_block)
    if blocks < 1:
        raise UserError(f"--kv-cache-memory {job.kv_cache_memory} GiB holds no KV block of {per_block} bytes")
    needed = job.max_num_seqs * -(-cfg.max_seq_len // job.block_size)
    return blocks if job.kv_cache_memory else min(blocks, needed)


def _device_memory(device) -> int:
    """All the memory the block pool could ever use: the GPU's, or the host's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
