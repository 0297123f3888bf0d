"""Training throughput and MFU of one device (the GPU check a lent GPU session runs first).

Trains a Llama-style model through `phalanx.train.loop.train` on one process (bf16 autocast on
CUDA, fp32 on CPU) and prints tokens/s and model FLOPs utilization: achieved model FLOP/s
over the device's peak. Model FLOPs per token are 6 N (N = parameters outside the embedding)
plus 6 L s h for causal attention (12 L s h halved by the mask), the PaLM-paper accounting.
It also checks the CUDA/NCCL path: on a GPU, 1 step with a 1-process NCCL group runs first.

    .venv/bin/python benchmarks/single_device_throughput.py                 # GPU: ~1B model
    .venv/bin/python benchmarks/single_device_throughput.py --size tiny     # CPU smoke run

The peak defaults to 989 TFLOP/s (H100/H200 dense bf16) on CUDA; pass --peak-tflops otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
from pathlib import Path

import torch

from phalanx.model.config import PRESETS, ModelConfig
from phalanx.train.config import TrainConfig

SIZES = {
    "tiny": ModelConfig(name="bench-tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256),
    "1b": ModelConfig(name="bench-1b", vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                      ffn_dim=5632, max_seq_len=4096),
}


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    from phalanx.model.init import build_model

    model = build_model(cfg)  # meta device: shapes only
    params = sum(p.numel() for name, p in model.named_parameters() if "tok_embeddings" not in name)
    return 6 * params + 6 * cfg.n_layers * seq_len * cfg.dim


def nccl_check() -> str:
    import torch.distributed as dist

    from phalanx.ports import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    value = torch.ones(4, device="cuda")
    dist.all_reduce(value)
    dist.destroy_process_group()
    return f"NCCL all_reduce on 1 rank: {value.tolist()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="1b" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048 if torch.cuda.is_available() else 128)
    parser.add_argument("--peak-tflops", type=float, default=989.0 if torch.cuda.is_available() else 0.0)
    args = parser.parse_args()
    from phalanx.train.loop import train
    from phalanx.train.metrics import read_metrics

    cuda = torch.cuda.is_available()
    if cuda:
        print(torch.cuda.get_device_name(), "|", nccl_check())
    model = SIZES[args.size]
    PRESETS[model.name] = model  # registered for this process only
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(model=model.name, steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len,
                          dtype="bf16" if cuda else "fp32", eval_every=0, ckpt_every=0, sample_tokens=0,
                          progress=False, out=out, warmup_steps=2)
        train(cfg, Path(out))
        records = read_metrics(Path(out) / "metrics.jsonl")[3:]  # the first steps warm up kernels
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in records)
    achieved = tokens_per_s * model_flops_per_token(model, args.seq_len)
    print(f"{model.name}: {args.global_batch} x {args.seq_len} tokens per step, median {tokens_per_s:,.0f} tokens/s, "
          f"{achieved / 1e12:.2f} model TFLOP/s, peak memory {max(r['peak_mem_mb'] for r in records):,.0f} MB")
    if args.peak_tflops:
        print(f"MFU = {achieved / 1e12 / args.peak_tflops:.1%} of {args.peak_tflops:g} TFLOP/s")


if __name__ == "__main__":
    main()
