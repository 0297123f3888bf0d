"""The flags `plan --serve` and `simulate --serve` share, and the workload and dtypes they
describe (torch-free): one home for both commands (serve/cli.py, serve/sim_report.py)."""

from __future__ import annotations

import argparse

from phalanx.errors import UserError
from phalanx.model.config import ModelConfig
from phalanx.planner.hardware import Cluster
from phalanx.planner.serve.expert_load import parse_expert_load
from phalanx.planner.serve.rates import ServeLoad
from phalanx.scheduling.serving_bounds import check_counts

TRAINING_FLAGS = ("--global-batch", "--seq-len", "--dtype", "--zero-levels", "--any-runtime", "--tp-overlap",
                  "--sp-regather", "--expert-slots", "--plan")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """The flags `plan --serve` and `simulate --serve` share."""
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # what brought the argv here
    p.add_argument("--model", required=True, help="preset name, project JSON or Hugging Face config.json")
    p.add_argument("--cluster", action="append", help="preset or file; repeat to compare clusters (default local)")
    p.add_argument("--gpus", type=int, required=True, help="devices in all")
    p.add_argument("--isl", type=int, required=True, help="prompt (input) tokens per request")
    p.add_argument("--osl", type=int, required=True, help="output tokens per request")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="requests in flight at once (closed loop)")
    load.add_argument("--rate", type=float, help="Poisson arrivals, requests per second, whole deployment")
    p.add_argument("--ttft-ms", type=float, help="target time to first token, ms")
    p.add_argument("--tpot-ms", type=float, help="target time per output token, ms")
    p.add_argument("--phase", choices=("both", "prefill", "decode"), default="both",
                   help="rate one side alone (prefill: input tokens/s; decode at contexts isl to isl + osl)")
    p.add_argument("--weight-dtype", choices=("bf16", "fp8", "fp4", "fp32"), default=None,
                   help="weights and GEMMs (default bf16 on GPUs, fp32 on a CPU as phalanx serve runs)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8", "fp32"), default=None, help="KV cache (default: as activations)")
    p.add_argument("--disaggregate", choices=("auto", "on", "off"), default="auto",
                   help="prefill and decode on separate GPUs (auto: whichever ranks higher)")
    p.add_argument("--fix", default="",
                   help="pin tp=,ep=,dp=,pp=,slots=,max_batch=,max_batch_tokens=,instances=")
    p.add_argument("--expert-load", metavar="FILE|zipf:S",
                   help="how unevenly tokens pick the routed experts: a [layers][experts] load table (JSON, .npy, "
                        "a run directory) or zipf:S (the i-th hottest expert carries 1/i^S); default even")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--top", type=int, default=10, help="plans to print")
    for flag in TRAINING_FLAGS:
        p.add_argument(flag, dest="training_" + flag[2:].replace("-", "_"), nargs="?", const=True,
                       default=None, help=argparse.SUPPRESS)


def load_from(args, model: ModelConfig) -> ServeLoad:
    if args.training_expert_slots is not None:
        raise UserError("--expert-slots belongs to training plans; a serving plan pins its expert slots with "
                        "--fix slots=S (the search tries them otherwise)")
    for flag in TRAINING_FLAGS:
        if getattr(args, "training_" + flag[2:].replace("-", "_")) is not None:
            raise UserError(f"{flag} belongs to training plans; with --serve give --isl/--osl, --weight-dtype/--kv-dtype "
                            "and a serving --fix")
    checks = [("--gpus", args.gpus, 1), ("--isl", args.isl, 1), ("--osl", args.osl, 1)]
    if args.concurrency is not None:
        checks.append(("--concurrency", args.concurrency, 1))
    for name, value, least in checks:
        if value < least:
            raise UserError(f"{name}={value} must be at least {least}")
    check_counts(isl_plus_osl=args.isl + args.osl, concurrency=args.concurrency)
    for name, value in (("--rate", args.rate), ("--ttft-ms", args.ttft_ms), ("--tpot-ms", args.tpot_ms)):
        if value is not None and not (value > 0 and value != float("inf")):
            raise UserError(f"{name}={value} must be a positive number")
    if args.phase == "prefill" and args.tpot_ms is not None:
        raise UserError("--phase prefill rates prompts alone; --tpot-ms is a decode target")
    if args.phase == "decode" and args.ttft_ms is not None:
        raise UserError("--phase decode rates decoding alone; --ttft-ms is a prefill target")
    return ServeLoad(isl=args.isl, osl=args.osl, concurrency=args.concurrency, rate=args.rate,
                     ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, phase=args.phase,
                     expert_load=parse_expert_load(args.expert_load, n_experts=model.n_experts, model=model.name,
                                                   moe_layers=model.n_moe_layers))


def check_lengths(load: ServeLoad, model) -> None:
    """--isl + --osl within the model's positions: `phalanx serve` refuses a longer request, so a
    plan for it would be rated for requests that never run."""
    if load.isl + load.osl > model.max_seq_len:
        raise UserError(f"--isl {load.isl} + --osl {load.osl} = {load.isl + load.osl} tokens is beyond the model's "
                        f"{model.max_seq_len} positions: phalanx serve would refuse every such request")


def dtypes_for(args, cluster: Cluster) -> tuple[str, str]:
    """(weights, KV) dtypes on `cluster`; a dtype its tensor cores lack is an error."""
    weight = args.weight_dtype or ("fp32" if cluster.shared_compute else "bf16")
    kv = args.kv_dtype or ("fp32" if weight == "fp32" else "bf16")
    if weight == "fp8" and not cluster.fp8_tflops and not cluster.shared_compute:
        raise UserError(f"--weight-dtype fp8: cluster {cluster.name!r} has no fp8 tensor cores (fp8_tflops=0)")
    if weight == "fp4" and not cluster.fp4_tflops:
        raise UserError(f"--weight-dtype fp4: cluster {cluster.name!r} has no fp4 tensor cores (fp4_tflops=0); "
                        "dgx-b200 and gb200-nvl72 have")
    return weight, kv
