"""The flags `phalanx plan` and `phalanx simulate` share, and the implementation (`Options`) they
name: one place, so the two commands cannot drift apart and neither imports the other."""

from __future__ import annotations

import argparse

from phalanx.errors import UserError
from phalanx.planner.options import Options, trainer_options


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ZeRO levels") from None
    if not levels or any(z not in (0, 1, 2, 3) for z in levels):
        raise argparse.ArgumentTypeError(f"ZeRO levels must be among 0,1,2,3, got {text!r}")
    return levels


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """The model, workload and implementation flags `phalanx plan` and `phalanx simulate` share."""
    p.add_argument("--model", required=True, help="preset name, project JSON or Hugging Face config.json")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--tp-overlap", action="store_true",
                   help="assume TP collectives are pipelined with GEMMs (Megatron's tp-comm-overlap)")
    p.add_argument("--cp-overlap", action="store_true",
                   help="context parallelism passes keys and values around a ring, each step hidden behind a step "
                        "of attention: the phalanx trainer's cp_ring=true wherever cp > 1 (without the flag the "
                        "planner picks gather or ring per layout); with --any-runtime, Megatron-Core's and "
                        "torchtitan's ring (Llama 3 all-gathered them on the critical path)")
    p.add_argument("--sp-regather", action="store_true",
                   help="with --any-runtime: sequence parallelism keeps its GEMM inputs sharded and gathers them "
                        "again in backward (Megatron; the phalanx trainer always does)")
    p.add_argument("--zero-levels", type=_levels, default=(0, 2, 3),
                   help="ZeRO levels to search (default 0,2,3: what the phalanx trainer runs; 1 for other runtimes)")
    p.add_argument("--any-runtime", action="store_true",
                   help="other implementations: also layouts the phalanx trainer does not run (tp not dividing "
                        "the KV heads or the vocabulary), experts split over tp, Megatron-style mixed precision")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="the phalanx trainer's --dtype the plan is for (memory: fp32 weights and AdamW moments "
                        "either way; bf16 gathers and activations). Default: bf16 on a GPU cluster (its peak is "
                        "the bf16 peak), fp32 on a CPU one (the trainer's default)")
    p.add_argument("--expert-slots", type=int, default=0, metavar="S",
                   help="the phalanx trainer's --expert-slots: S expert slots over each ep group (>= the experts, "
                        "a multiple of ep), S / ep per rank of weights, gradients and optimizer state; only layouts "
                        "the trainer runs slots in (ep > 1, experts under DDP-style data parallelism)")
    p.add_argument("--price", action="append", default=[], metavar="CLUSTER=USD_PER_HOUR",
                   help="dollars per GPU hour on a cluster (preset or file name); repeat for several clusters, "
                        "or for each preset a mixed cluster file's groups use. Adds cost per million tokens to "
                        "every plan")


def options_for(args, cluster) -> Options:
    """The implementation a plan is for: the phalanx trainer (its precision and memory,
    `trainer_options`), or with --any-runtime the published runs' (Megatron-style)."""
    if args.any_runtime:
        if args.dtype:
            raise UserError("--dtype sets the phalanx trainer's precision; --any-runtime plans other "
                            "implementations' mixed precision (bf16 weights, fp32 master copy and moments)")
        if args.expert_slots:
            raise UserError("--expert-slots plans the phalanx trainer's expert slots; --any-runtime plans other "
                            "implementations, which have none")
        return Options(tp_overlap=args.tp_overlap, sp_regather=args.sp_regather, tp_splits_experts=True,
                       cp_overlap=args.cp_overlap)
    if args.expert_slots < 0:
        raise UserError(f"--expert-slots={args.expert_slots} must not be negative (0: one slot per expert)")
    dtype = args.dtype or ("fp32" if cluster.shared_compute else "bf16")
    return trainer_options(dtype, cluster, tp_overlap=args.tp_overlap, expert_slots=args.expert_slots,
                           cp_overlap=args.cp_overlap)
