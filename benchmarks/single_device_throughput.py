"""Training throughput and MFU of one device, eager and with `--compile` and `--float8`.

    .venv/bin/python benchmarks/single_device_throughput.py                      # GPU: ~1B model, eager
    .venv/bin/python benchmarks/single_device_throughput.py --compile --float8   # + compiled, + compiled float8
    .venv/bin/python benchmarks/single_device_throughput.py --size tiny --compile --float8   # CPU dry run

Each arm trains a Llama-style model through `phalanx.train.loop.train` on one process (bf16
autocast on CUDA, fp32 on CPU) with AdamW: eager always; `--compile` adds the compiled arm
(torch.compile per block) and prints compile/eager; `--float8` adds a float8 arm (torchao,
tensorwise; compiled too when `--compile` is given, as torchtitan measures it) and prints
float8/compile. The ratios of tokens/s stand beside torchtitan's published ones (Llama 3 8B on
8 H100s, FSDP: 1.16x from compile, a further 1.28x from float8; quoted in issue 20).

Per arm: tokens/s (median over the steps after the first 3, which compile and warm up) and
model FLOPs utilization: achieved model FLOP/s over the device's peak. On CUDA also the energy
the GPU drew, from the `energy_j` of those steps' rows (NVML's counter, phalanx/train/
gpu_energy.py): their mean joules per step and per token, and their sum over the steps' summed
step times as the mean power; where the counter cannot be read, one line says why. Model FLOPs per token
are 6 N (N = parameters outside the embedding) plus 6 L s h for causal attention (12 L s h
halved by the mask), the PaLM-paper accounting. On a GPU, 1 step with a 1-process NCCL group
runs first (the CUDA/NCCL path).

`--float8` is a speed measurement: on a GPU without float8 matmuls (compute capability < 8.9)
it is refused in one line. On CPU (`--size tiny`) every arm runs so the script is tested, but
float8 matmuls are emulated there and the float8 figure says nothing about speed.
The peak defaults to 989 TFLOP/s (H100/H200 dense bf16) on CUDA; pass --peak-tflops otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
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
PUBLISHED = {"compile": 1.16, "float8": 1.28}
"""torchtitan's published gains (Llama 3 8B, 8 H100s): compile over eager FSDP, float8 over compile."""
WARMUP = 3


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


def arms(compile: bool, float8: bool) -> dict[str, dict]:
    """Arm name -> the TrainConfig fields it sets."""
    chosen = {"eager": {}}
    if compile:
        chosen["compile"] = {"compile": True}
    if float8:
        chosen["float8"] = {"compile": compile, "float8": True}
    return chosen


def run_arm(model: ModelConfig, args, settings: dict) -> dict:
    """Train one arm; its median tokens/s and peak memory over the steps after warm-up."""
    from phalanx.train.loop import train
    from phalanx.train.metrics import read_metrics

    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(model=model.name, steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len,
                          dtype="bf16" if torch.cuda.is_available() else "fp32", eval_every=0, ckpt_every=0,
                          sample_tokens=0, progress=False, out=out, warmup_steps=2, **settings)
        train(cfg, Path(out))
        records = read_metrics(Path(out) / "metrics.jsonl")[WARMUP:]
    result = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
              "peak_mem_mb": max(r["peak_mem_mb"] for r in records)}
    result.update(measured_energy(records, tokens_per_step=args.global_batch * args.seq_len))
    return result


def measured_energy(records: list[dict], *, tokens_per_step: int) -> dict:
    """Mean joules per step and per token, and the mean power, of steps whose rows all have
    `energy_j` (CUDA with NVML's counter); {} otherwise. The mean, not the median: energy adds
    up, and a step's share of the counter's coarse updates evens out over the steps."""
    if not records or any(r.get("energy_j") is None for r in records):
        return {}
    joules = statistics.fmean(r["energy_j"] for r in records)
    return {"energy_j_per_step": joules, "energy_j_per_token": joules / tokens_per_step,
            "watts": sum(r["energy_j"] for r in records) / sum(r["step_time_s"] for r in records)}


def energy_line(result: dict) -> str:
    """The arm line's energy cell (device_check_parts.py reads it), or ""."""
    if "energy_j_per_step" not in result:
        return ""
    return (f"  energy {result['energy_j_per_step']:,.1f} J/step, {result['energy_j_per_token']:.4g} J/token "
            f"({result['watts']:,.0f} W)")


def why_no_energy() -> str:
    """Why this GPU's energy is not read (gpu_energy.counter_for's reason), or "" when it is."""
    from phalanx.train.gpu_energy import counter_for

    try:
        counter, why = counter_for(str(torch.cuda.get_device_properties(0).uuid))
    except Exception as error:  # the trainer's energy_counter says the same and trains on
        return f"reading NVML failed ({type(error).__name__}: {error})"
    if counter is not None:
        counter.close()
        return "the counter reads here, but the steps' rows have no energy_j"
    return why


def refuse_float8_speed_without_float8_matmuls() -> None:
    """--float8 measures speed: a GPU without float8 matmuls has none to measure."""
    from phalanx.parallel.float8 import MIN_CAPABILITY

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability()
        sys.exit(f"single_device_throughput: error: --float8 measures float8 speed, which needs float8 matmuls "
                 f"(compute capability >= 8.9); {torch.cuda.get_device_name()} has {major}.{minor}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="1b" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048 if torch.cuda.is_available() else 128)
    parser.add_argument("--peak-tflops", type=float, default=989.0 if torch.cuda.is_available() else 0.0)
    parser.add_argument("--compile", action="store_true", help="add the compiled arm (torch.compile per block)")
    parser.add_argument("--float8", action="store_true", help="add the float8 arm (compiled too with --compile)")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    if args.float8:
        refuse_float8_speed_without_float8_matmuls()

    cuda = torch.cuda.is_available()
    if cuda:
        print(torch.cuda.get_device_name(), "|", nccl_check())
    model = SIZES[args.size]
    PRESETS[model.name] = model  # registered for this process only
    flops = model_flops_per_token(model, args.seq_len)
    print(f"{model.name}: {args.global_batch} x {args.seq_len} tokens per step, {'bf16' if cuda else 'fp32'}, AdamW, "
          f"{args.steps} steps per arm (median after {WARMUP}), torch {torch.__version__}")
    results = {}
    for name, settings in arms(args.compile, args.float8).items():
        results[name] = result = run_arm(model, args, settings)
        achieved = result["tokens_per_s"] * flops
        line = (f"  {name:8s} {result['tokens_per_s']:12,.0f} tokens/s  {achieved / 1e12:8.3f} model TFLOP/s  "
                f"peak memory {result['peak_mem_mb']:,.0f} MB")
        if args.peak_tflops:
            line += f"  MFU {achieved / 1e12 / args.peak_tflops:.1%} of {args.peak_tflops:g} TFLOP/s"
        print(line + energy_line(result))
        if cuda and "energy_j_per_step" not in result:
            print(f"  {name}: energy not measured: {why_no_energy()}")
    if "compile" in results:
        ratio = results["compile"]["tokens_per_s"] / results["eager"]["tokens_per_s"]
        print(f"compile / eager  = {ratio:.2f}x  (torchtitan: {PUBLISHED['compile']}x)")
    if "float8" in results:
        base = "compile" if args.compile else "eager"
        ratio = results["float8"]["tokens_per_s"] / results[base]["tokens_per_s"]
        note = "" if cuda else "; CPU: float8 matmuls emulated, not a speed measurement"
        print(f"float8 / {base:7s} = {ratio:.2f}x  (torchtitan, float8 / compile: {PUBLISHED['float8']}x{note})")


if __name__ == "__main__":
    main()
