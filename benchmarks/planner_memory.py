"""The planner's memory model against the trainer's measured tensor memory, per rank, by category.

    PYTHONPATH=. python benchmarks/planner_memory.py                  # CPU, fp32, about 3 minutes
    PYTHONPATH=. python benchmarks/planner_memory.py --device cuda    # a GPU: the one-process layouts
    PYTHONPATH=. python benchmarks/planner_memory.py --only "dp=2,zero=2"   # one layout, to investigate
    PYTHONPATH=. python benchmarks/planner_memory.py --only "small microbatches=1" --model tiny   # seconds

For each layout, the model is built and stepped as `phalanx train` does (memory_measure.py)
on forked gloo ranks, and PyTorch's trackers (`MemTracker`, `FSDPMemTracker`) report each
category's peak on every rank; the planner's prediction (`phalanx.planner.cost.evaluate`, the
`local` cluster, the run's dtype) is compared with the most loaded rank's figure. Activations
include the logits (the planner counts them apart). On a CPU, parameters, gradients and
optimizer state that `offload=true` moves to the host live in the same memory, so the host
part (`Estimate.host_breakdown`) is added to the prediction there; on a GPU it is not, and
the total is also read from `torch.cuda.max_memory_allocated`.
The prediction uses the options the trainer runs with (`cost.trainer_options`: its own stored
tensors, its RMSNorm saving input and rstd, sequence parallelism keeping shards);
benchmarks/activation_probe.py lists the saved tensors behind the activation terms.

Layouts are split into two halves: model changes were decided on the first ("decide") only;
the second ("hold-out") is reported as it came out. Target: median |error| <= 15% per
category and in total, in each half.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_measure import CATEGORIES, measure_rank  # noqa: E402

TARGET = 0.15
GLOBAL_BATCH, SEQ_LEN = 8, 128
# (half, processes, model, plan): each zero level, offload, 1f1b/interleaved, tp, ep; 1, 2, 4 processes.
# zbv is left out: its split backward calls autograd.grad, which the trackers' module hooks refuse
# ("A leaf node was passed to _will_engine_execute_node ... autograd.grad()", torch 2.13).
LAYOUTS = [
    ("decide", 1, "small", "microbatches=1"),
    ("decide", 2, "small", "dp=2,zero=2"),
    ("decide", 2, "small", "tp=2,sp=true"),
    ("decide", 2, "small", "pp=2,microbatches=4"),
    ("decide", 4, "small", "dp=4,zero=3,microbatches=2"),
    ("decide", 2, "tiny-moe", "dp=2,ep=2"),
    ("hold-out", 1, "small", "microbatches=2,recompute=full"),
    ("hold-out", 2, "small", "dp=2"),
    ("hold-out", 2, "small", "dp=2,zero=3,offload=true"),
    ("hold-out", 2, "small", "pp=2,schedule=interleaved,virtual=2,microbatches=4"),
    ("hold-out", 4, "small", "dp=2,tp=2"),
    ("hold-out", 4, "tiny-moe", "dp=4,ep=2,microbatches=2"),
]


def predict(model_name: str, plan_text: str, world: int, dtype: str, device: str) -> dict[str, float]:
    """The planner's bytes per category for the most loaded rank of this run."""
    from phalanx.model.by_name import model_config
    from phalanx.plan import plan_from_string
    from phalanx.planner.cost import evaluate
    from phalanx.planner.options import trainer_options
    from phalanx.planner.hardware import cluster_from_name
    from phalanx.planner.layout import Layout, Workload

    plan = plan_from_string(plan_text)
    model = model_config(model_name)
    m = plan.num_microbatches
    layout = Layout(dp=plan.dp, tp=plan.tp, pp=plan.pp, ep=plan.ep, mbs=GLOBAL_BATCH // plan.dp // m, microbatches=m,
                    schedule=plan.schedule, virtual=plan.virtual, recompute=plan.recompute,
                    recompute_layers=plan.recompute_layers, zero=plan.zero, sp=plan.sp, replicate=plan.replicate,
                    offload=plan.offload)
    cluster = cluster_from_name("local")
    est = evaluate(model, cluster, Workload(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN), layout,
                   trainer_options(dtype, cluster))
    got = {k: est.memory_breakdown[k] for k in ("parameters", "gradients", "optimizer_state")}
    got["activations"] = est.memory_breakdown["activations"] + est.memory_breakdown["logits"]
    got["total"] = est.memory_bytes
    if device == "cpu" and layout.offload:  # the host is this device's memory too
        for key, value in est.host_breakdown.items():
            got[key] += value
            got["total"] += value
    return got


def measure(model_name: str, plan_text: str, world: int, dtype: str, device: str) -> dict[str, float]:
    """Measured bytes per category: each category's maximum over ranks (the planner predicts the
    most loaded rank), and the largest total."""
    if device == "cuda":
        import torch.distributed as dist

        if world != 1:
            raise SystemExit("--device cuda measures one-process layouts (one GPU)")
        dist.init_process_group("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:29533")
        try:
            ranks = [measure_rank(model_name, plan_text, GLOBAL_BATCH, SEQ_LEN, dtype, "cuda")]
        finally:
            dist.destroy_process_group()
    else:
        from phalanx.testing.fork_ranks import run_ranks

        ranks = run_ranks(world, measure_rank, model_name, plan_text, GLOBAL_BATCH, SEQ_LEN, dtype, "cpu",
                          timeout_s=300.0)
    return {key: max(r[key] for r in ranks) for key in ranks[0]}


def error(predicted: float, measured: float) -> float:
    return predicted / measured - 1 if measured else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default: fp32 on cpu, bf16 on cuda")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="measure only the layouts whose plan contains TEXT (e.g. 'dp=2,zero=2'), to investigate one")
    parser.add_argument("--model", default=None,
                        help="this model in every chosen layout instead of its own (e.g. tiny: a quick run of the script)")
    args = parser.parse_args(argv)
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    layouts = [(half, world, args.model or model, plan) for half, world, model, plan in LAYOUTS
               if (args.device == "cpu" or world == 1) and (args.only is None or args.only in f"{model} {plan}")]
    if not layouts:
        raise SystemExit(f"no layout matches --only {args.only!r}")
    keys = (*CATEGORIES, "total")
    errors: dict[str, dict[str, list[float]]] = {}
    print(f"device {args.device}, dtype {dtype}, global batch {GLOBAL_BATCH}, seq {SEQ_LEN}; MiB predicted/measured (error)")
    for half, world, model_name, plan_text in layouts:
        began = time.perf_counter()
        measured = measure(model_name, plan_text, world, dtype, args.device)
        predicted = predict(model_name, plan_text, world, dtype, args.device)
        cells = []
        for key in keys:
            e = error(predicted[key], measured[key])
            errors.setdefault(half, {}).setdefault(key, []).append(abs(e))
            cells.append(f"{key} {predicted[key] / 2**20:.1f}/{measured[key] / 2**20:.1f} ({e:+.0%})")
        if "allocator_total" in measured:
            cells.append(f"allocator {measured['allocator_total'] / 2**20:.1f}")
        print(f"{half:8s} {world} {model_name:8s} {plan_text:50s} " + "  ".join(cells)
              + f"  [{time.perf_counter() - began:.0f} s]", flush=True)
    for half, by_key in errors.items():
        medians = {key: statistics.median(values) for key, values in by_key.items()}
        line = ", ".join(f"{key} {value:.1%}" for key, value in medians.items())
        ok = all(value <= TARGET for value in medians.values())
        print(f"median |error|, {half} half ({len(by_key['total'])} layouts): {line} "
              f"(target {TARGET:.0%} each: {'met' if ok else 'NOT met'})")


if __name__ == "__main__":
    main()
