"""`phalanx plan --serve`'s JSON records (their names are an API), table, the `phalanx serve`
command of each plan, and why the runners-up lose. The table layout is the training plan's
(report.format_table)."""

from __future__ import annotations

from phalanx.planner.report import format_table
from phalanx.planner.serve.search import ServePlan
from phalanx.planner.serve.step import ServeLayout

GIB = 2**30
REBALANCE_EVERY = 64
"""`phalanx serve --rebalance-every` a plan priced for a zipf skew (or a load file of another
layer count than the model's) prints: the engine starts from the placement for even loads and
reaches the skew's only by measuring it (docs/serve.md's example value; the planner prices the
placement reached, not the steps before it)."""


def expert_slots(plan: ServePlan, layout: ServeLayout) -> int:
    """The `--expert-slots` of a plan's layout: its slots, or one per expert where a skew was
    priced with the balancer's placement of them; 0: none (one slot per expert, in order)."""
    if layout.ep == 1:
        return 0
    return layout.slots or (plan.expert_load.experts if plan.expert_load is not None else 0)


COLUMNS = ("#", "inst", "dp", "tp", "pp", "ep", "slots", "max_batch", "budget", "TTFT ms", "TPOT p50", "TPOT p99",
           "out tok/s/GPU", "in tok/s/GPU", "goodput req/s", "phalanx serve")


def serve_command(plan: ServePlan, model_name: str, *, layout: ServeLayout | None = None) -> str:
    """The `phalanx serve` command of one instance (run it `instances` times, one per group
    of devices, behind a load balancer)."""
    lay = layout or plan.layout
    parts = ["phalanx serve", f"--model {model_name}"]
    if lay.gpus > 1:
        parts.append(f"--nproc {lay.gpus} --plan {lay.plan_string()}")
    if lay.weight_dtype in ("bf16", "fp32"):
        parts.append(f"--dtype {lay.weight_dtype}")
    slots = expert_slots(plan, lay)
    if slots:
        parts.append(f"--expert-slots {slots}")
        if plan.expert_load is not None:
            parts.append(f"--expert-placement {plan.expert_load.path}" if plan.expert_load.path
                         else f"--rebalance-every {REBALANCE_EVERY}")
    parts.append(f"--max-num-seqs {plan.max_batch} --max-num-batched-tokens {plan.max_batch_tokens}")
    parts.append(f"--kv-cache-memory {plan.memory.kv_pool / GIB:.3g}")
    return " ".join(parts)


def serve_record(plan: ServePlan, model_name: str) -> dict:
    """One plan as JSON: the issue's keys first, then the details."""
    lay, r = plan.layout, plan.rates
    record = {
        "tp": lay.tp, "ep": lay.ep, "dp": lay.dp, "pp": lay.pp, "instances": plan.instances,
        "prefill_gpus": plan.prefill_gpus, "decode_gpus": plan.decode_gpus,
        "max_batch": plan.max_batch, "max_batch_tokens": plan.max_batch_tokens,
        "ttft_ms": r.ttft_s * 1e3, "tpot_ms_p50": r.tpot_p50_s * 1e3, "tpot_ms_p99": r.tpot_p99_s * 1e3,
        "output_tokens_per_s_per_gpu": r.output_tps_gpu, "input_tokens_per_s_per_gpu": r.input_tps_gpu,
        "goodput_req_per_s": r.goodput,
        "serve": serve_command(plan, model_name),
        "plan": lay.plan_string(), "weight_dtype": lay.weight_dtype, "kv_dtype": lay.kv_dtype,
        "expert_slots": expert_slots(plan, lay), "expert_imbalance": lay.expert_imbalance,
        "expert_imbalance_one_slot_each": plan.imbalance_one_slot_each,
        "expert_load": plan.expert_load.name if plan.expert_load is not None else "even",
        "running_batch": r.batch, "overloaded": r.overloaded,
        "runs_in_phalanx_serve": not plan.notes,
        "not_in_phalanx_serve": list(plan.notes),
        "memory_gib_per_gpu": {"weights": plan.memory.weights / GIB, "workspace": plan.memory.workspace / GIB,
                               "kv_cache": plan.memory.kv_pool / GIB},
        "step_breakdown_ms": {k: v * 1e3 for k, v in r.breakdown.items()},
    }
    if plan.prefill_layout is not None:
        record["prefill"] = {"tp": plan.prefill_layout.tp, "ep": plan.prefill_layout.ep,
                             "dp": plan.prefill_layout.dp, "pp": plan.prefill_layout.pp,
                             "instances": plan.prefill_instances,
                             "serve": serve_command(plan, model_name, layout=plan.prefill_layout)}
    return record


def table_rows(ranked: list[ServePlan]) -> list[list[str]]:
    rows = []
    for i, p in enumerate(ranked, start=1):
        lay, r = p.layout, p.rates
        where = "yes" if not p.notes else "no: " + ", ".join(p.notes)
        disagg = f"{p.prefill_gpus}P+{p.decode_gpus}D " if p.prefill_layout is not None else ""
        slots = expert_slots(p, lay)
        rows.append([str(i), f"{disagg}{p.instances}", str(lay.dp), str(lay.tp), str(lay.pp), str(lay.ep),
                     f"{slots} ({lay.expert_imbalance:.2f})" if slots or lay.expert_imbalance else "-",
                     # Past capacity the queue grows without bound: no TTFT to show.
                     str(p.max_batch), str(p.max_batch_tokens), "overloaded" if r.overloaded else f"{r.ttft_s * 1e3:,.1f}",
                     f"{r.tpot_p50_s * 1e3:.2f}", f"{r.tpot_p99_s * 1e3:.2f}", f"{r.output_tps_gpu:,.0f}",
                     f"{r.input_tps_gpu:,.0f}", f"{r.goodput:.3g}", where])
    return rows


def table(ranked: list[ServePlan]) -> str:
    return format_table(COLUMNS, table_rows(ranked))


def explain(ranked: list[ServePlan], *, tpot_ms: float | None, ttft_ms: float | None) -> list[str]:
    """Why each runner-up loses to #1: a missed target, else the step cause per output token
    where it spends most beyond the winner."""
    if not ranked:
        return []
    best = ranked[0]
    top = max(best.rates.breakdown, key=best.rates.breakdown.get)
    share = best.rates.breakdown[top] / max(sum(best.rates.breakdown.values()), 1e-12)
    lines = [f"#1 spends most of its {best.rates.tpot_p50_s * 1e3:.3g} ms step on {top} ({share:.0%}); "
             "the others lose to it on:"]
    for rank, p in enumerate(ranked[1:], start=2):
        r = p.rates
        if tpot_ms is not None and r.tpot_p99_s * 1e3 > tpot_ms:
            lines.append(f"#{rank}: TPOT p99 {r.tpot_p99_s * 1e3:.3g} ms misses the {tpot_ms:g} ms target")
            continue
        if ttft_ms is not None and r.ttft_s * 1e3 > ttft_ms:
            lines.append(f"#{rank}: TTFT {r.ttft_s * 1e3:.3g} ms misses the {ttft_ms:g} ms target")
            continue
        if r.overloaded:
            lines.append(f"#{rank}: overloaded (the load exceeds what {p.max_batch} sequences per rank serve)")
            continue
        if (abs(r.goodput - best.rates.goodput) <= 1e-9 * max(best.rates.goodput, 1.0)
                and r.output_tps_gpu >= 0.999 * best.rates.output_tps_gpu):
            lines.append(f"#{rank}: the same goodput and tokens/s at this load, but a slower step: TPOT p50 "
                         f"{r.tpot_p50_s * 1e3:.3g} ms against {best.rates.tpot_p50_s * 1e3:.3g}")
            continue
        # Seconds per output token per GPU, by cause: the winner's and this plan's.
        def per_token(plan: ServePlan) -> dict[str, float]:
            scale = plan.layout.tp * plan.layout.pp / max(plan.rates.batch, 1e-9)
            return {k: v * scale for k, v in plan.rates.breakdown.items()}
        mine, theirs = per_token(p), per_token(best)
        cause = max(mine, key=lambda k: mine[k] - theirs.get(k, 0.0))
        gap = 1 - r.output_tps_gpu / max(best.rates.output_tps_gpu, 1e-12)
        lines.append(f"#{rank}: {gap:.0%} fewer output tokens/s per GPU, mostly {cause} "
                     f"(+{(mine[cause] - theirs.get(cause, 0.0)) * 1e6:.3g} us per token per GPU; "
                     f"batch {r.batch:.0f} per rank vs {best.rates.batch:.0f})")
    return lines
