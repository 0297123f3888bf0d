"""A plan checked against the model, the batch and the run's flags, before any process starts.

Torch-free, so that `train/job.py` (and `world_change.py`, `generate`) work a run out without
importing `parallel/`; the parallel modules that apply each part import their rule from here.
The rules that need only numbers live in `layout_rules.py`; these take the model's config.
(A plan's `split=` is parsed by `parallel/stage_split.py`, itself torch-free, only when given.)
"""

from __future__ import annotations

from phalanx import layout_rules as rules
from phalanx.errors import UserError
from phalanx.model.config import ModelConfig
from phalanx.plan import Plan, parse_split, weights_view


def validate_for_model(plan: Plan, cfg: ModelConfig, *, global_batch: int, seq_len: int, dtype: str = "fp32",
                       compile: bool = False, float8: bool = False, doc_mask: bool = False,
                       replica_groups: int = 1) -> Plan:
    """Checks that need the model's shape, the batch, `--dtype`, `--compile`, `--float8` and `--doc-mask`;
    raised before any worker starts. Returns the plan with its precision filled
    in from `dtype` (`resolve_precision`). `replica_groups`: the groups that share the global
    batch, each running `plan` on its share."""
    validate_ep(cfg, weights_view(plan))  # experts spread over dp x cp ranks
    problems = validate_tp(plan, cfg, seq_len) + validate_pp(plan, cfg)
    problems += validate_cp(plan, seq_len, cfg, doc_mask=doc_mask)
    problems += validate_compile(plan, compile) + validate_float8(plan, float8, moe=cfg.n_experts > 0)
    if cfg.tie_embeddings and plan.pp > 1:
        problems.append(f"model {cfg.name!r} ties its output projection to its embedding, which pp={plan.pp} "
                        "would place on different stages; use tp or dp instead")
    micro = replica_groups * plan.dp * plan.num_microbatches
    if global_batch % micro:
        groups = f"{replica_groups} replica groups x " if replica_groups > 1 else ""
        problems.append(
            f"global_batch={global_batch} must divide evenly into {groups}dp={plan.dp} ranks x "
            f"microbatches={plan.num_microbatches} (= {micro} micro-batches)"
        )
    if problems:
        raise UserError("invalid plan for this model: " + "; ".join(problems))
    return resolve_precision(plan, dtype)


def resolve_precision(plan: Plan, dtype: str) -> Plan:
    """`plan` with param_dtype and reduce_dtype filled in from `--dtype` (bf16 -> bf16 and fp32,
    fp32 -> fp32 and fp32).

    param_dtype is the dtype of the weights the forward computes with, in every layout: bf16 is
    mixed precision (bf16 copies of fp32 masters, `mixed_precision.py`), fp32 with `--dtype bf16`
    the older autocast over fp32 weights. bf16 weights with `--dtype fp32` would compute in bf16
    while the run says fp32, so that is refused in favour of `--dtype bf16`.
    """
    param = plan.param_dtype or dtype
    reduce = plan.reduce_dtype or "fp32"
    if param == "bf16" and dtype == "fp32":
        raise UserError(
            "invalid plan: param_dtype=bf16 with --dtype fp32 would compute in bf16; use --dtype bf16, which "
            "computes with bf16 copies of fp32 master weights in every layout"
        )
    return plan.replace(param_dtype=param, reduce_dtype=reduce)


def validate_float8(plan: Plan, enabled: bool, *, moe: bool) -> list[str]:
    """Problems of `--float8` with this plan and model (empty when it composes)."""
    if not enabled:
        return []
    problems = []
    if plan.tp > 1:
        problems.append(f"--float8 with tp={plan.tp}: torchao's float8 tensor-parallel styles are not wired in "
                        "yet; use dp, zero or pp")
    if moe:
        problems.append("--float8 with an MoE model: its routed experts are not nn.Linear and would stay in "
                        "high precision; use a dense model")
    return problems


REFUSED_SCHEDULES = ("zbv", "dualpipev")
"""Schedules whose backward runs in two passes, input gradients first, then weight gradients
through the retained graph: a compiled block's backward is one function, compiled with donated
buffers (AOT autograd frees its saved tensors as it goes), which cannot be run a second time
(torch: "requires create_graph=False and retain_graph=False")."""


def validate_compile(plan: Plan, enabled: bool) -> list[str]:
    """Problems of `--compile` with this plan (empty when it composes)."""
    if not enabled:
        return []
    problems = []
    if plan.pp > 1 and plan.schedule in REFUSED_SCHEDULES:
        problems.append(f"--compile with schedule={plan.schedule}: its backward runs twice per micro-batch (input, then "
                        "weight gradients), which a compiled block's one-shot backward does not allow; use 1f1b, gpipe "
                        "or interleaved")
    if plan.sp:
        problems.append("--compile with sp=true: sequence parallelism's shard-saving hooks (parallel/sequence_parallel.py) "
                        "read the saved-tensor hooks stack, which dynamo cannot trace; use tp without sp, or no --compile")
    return problems


def validate_pp(plan: Plan, cfg: ModelConfig) -> list[str]:
    """Why the pipeline part of `plan` cannot run `cfg` (empty if it can)."""
    if plan.pp == 1:
        return []
    problems = []
    if plan.split:
        try:
            parse_split(plan.split, plan.pp * plan.virtual, cfg.n_layers)
        except UserError as error:
            problems.append(str(error))
    if problem := rules.pipeline_problem(plan.schedule, pp=plan.pp, virtual=plan.virtual,
                                         microbatches=plan.num_microbatches, n_layers=cfg.n_layers, model=cfg.name):
        problems.insert(0, problem)
    return problems


def validate_tp(plan: Plan, cfg: ModelConfig, seq_len: int) -> list[str]:
    """Why `cfg` cannot be split `plan.tp` ways (empty if it can)."""
    tp = plan.tp
    if tp == 1:
        return []
    # MoE blocks stay out of tp (whole experts per rank; ep_over_tp splits the rows, not the
    # matrices), so no expert size is split.
    problems = [rules.tp_problem(tp, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, ffn_dim=cfg.ffn_dim,
                                 vocab_size=cfg.vocab_size, model=cfg.name)]
    if cfg.n_experts and plan.sp:
        problems.append(f"sp=true with mixture-of-experts model {cfg.name!r} is not supported yet "
                        "(the expert output would need re-sharding along the sequence)")
    if plan.sp and cfg.is_latent:
        problems.append(f"sp=true with latent attention ({cfg.name!r}) is not supported yet "
                        "(its replicated down-projections would see a sequence shard)")
    if plan.sp:
        problems.append(rules.sp_problem(tp, seq_len=seq_len))
    return [problem for problem in problems if problem]


def validate_ep(cfg: ModelConfig, plan: Plan) -> None:
    """The model-dependent rules for ep (layout_rules; Plan.validate checks that ep divides dp)."""
    if problem := rules.ep_problem(plan.ep, dp=plan.dp, n_experts=cfg.n_experts, model=cfg.name, tp=plan.tp,
                                   over_tp=plan.ep_over_tp):
        raise UserError(f"invalid plan: {problem}")


def validate_cp(plan: Plan, seq_len: int, cfg: ModelConfig | None = None, *, doc_mask: bool = False) -> list[str]:
    """Why `plan.cp` cannot cut sequences of `seq_len` (empty if it can). cp composes with every
    other part of a plan, latent attention, `--compile` and `--doc-mask` (docs/layout.md), but
    not with a sliding window, nor does `--doc-mask`: their attention runs the flash kernels on
    whole or causal blocks of keys (parallel/context_parallel_layout.py), never a band. Nor does
    the ring schedule (cp_ring=true) run latent attention (`rules.cp_ring_problem`)."""
    window = cfg.sliding_window if cfg is not None else 0
    if window and (plan.cp > 1 or doc_mask):
        what = f"cp={plan.cp}" if plan.cp > 1 else "--doc-mask"
        return [f"{what} does not support sliding-window attention (model {cfg.name!r} has sliding_window={window}): "
                "its attention blocks are whole or causal, never banded; use tp or pp for this model"]
    if plan.cp == 1:
        return []
    ring = rules.cp_ring_problem(plan.cp_ring, latent=cfg.is_latent, model=cfg.name) if cfg is not None else ""
    return [problem for problem in [ring, rules.cp_problem(plan.cp, seq_len=seq_len, tp=plan.tp, sp=plan.sp)] if problem]
