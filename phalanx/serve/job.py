"""The `phalanx serve` job: every flag checked before any weights are read, worked out once
into a frozen `ServeJob` that the launcher hands to every rank (serve/cli.py builds it; its
plan parsed here, once; pool_main.py checks each pool's plan with the same `check_plan`)."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

from phalanx import layout_rules as rules
from phalanx.errors import UserError
from phalanx.inference.model_source import resolve_model
from phalanx.plan import Plan, plan_from_string
from phalanx.plan_model_checks import validate_tp
from phalanx.scheduling.serving_bounds import check_counts
from phalanx.scheduling.slo_policy import SloPolicy, SloTargets
from phalanx.scheduling.speculation import SpeculativeConfig
from phalanx.serve.chat_template import ChatTemplate
from phalanx.launch.restart_policy import max_restarts
from phalanx.threads import check_requested

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
"""--max-request-bytes' default, 4 MiB: a prompt that fills a 128k-token context is ~0.5 MB of
text (about 4 bytes a token), ~3 MB with every character JSON-escaped (\\uXXXX), and as token
ids ~0.9 MB; beyond that a body cannot be a prompt the model holds, only work for the
tokenizer (http_limits.py applies it)."""
KEY_ENV = "PHALANX_API_KEY"


@dataclass(frozen=True)
class ServeJob:
    """Everything a serving rank needs from the command line, checked (`prepare_job`)."""
    model: str
    step: int | None
    tokenizer: str | None
    host: str
    port: int
    served_model_name: str
    plan: Plan
    """The layout, parsed and checked once for `nproc` ranks."""
    nproc: int
    device: str
    dtype: str
    """auto, fp32 or bf16 (loading.pick_dtype)."""
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory: float | None
    num_kv_blocks: int | None
    block_size: int
    max_waiting: int
    api_key: str | None
    max_request_bytes: int
    shutdown_grace: float
    collective_timeout: float
    expert_slots: int
    rebalance_every: int
    expert_placement: str | None
    generation_config: str
    chat_template: str | None
    """--chat-template FILE (checked: it reads and compiles), or None: the model's own."""
    tool_call_parser: str | None
    """--tool-call-parser NAME (tool_call_parsers.PARSERS), or None: the format the chat template shows."""
    threads: int
    max_restarts: int
    max_restarts_given: int | None
    """--max-restarts as given (None: the default), for the pool front's own instance restarts."""
    ttft_ms: float | None
    tpot_ms: float | None
    speculative: SpeculativeConfig | None = None
    """--speculative-config: guessed tokens per step (scheduling/speculation.py), or None: none."""
    compile: bool = False
    """--compile: decodes through a compiled graph where the model allows (compiled_decode.py)."""


def check_slo(args) -> dict:
    for name in ("ttft_ms", "tpot_ms"):
        value = getattr(args, name, None)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise UserError(f"--{name.replace('_', '-')} must be a positive number of milliseconds, got {value}")
    return {"ttft_ms": getattr(args, "ttft_ms", None), "tpot_ms": getattr(args, "tpot_ms", None)}


def slo_policy(job: ServeJob):
    """The SLO scheduler's policy for --ttft-ms/--tpot-ms (slo_policy.py), or None without them."""
    targets = slo_targets(job)
    return None if targets is None else SloPolicy(targets, job.max_num_batched_tokens)


def slo_targets(job: ServeJob):
    if job.ttft_ms is None and job.tpot_ms is None:
        return None
    ms = lambda value: None if value is None else value / 1000  # noqa: E731
    return SloTargets(ttft_s=ms(job.ttft_ms), tpot_s=ms(job.tpot_ms))


def _at_least(args, name: str, low: int) -> None:
    value = getattr(args, name)
    if value is not None and value < low:
        raise UserError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def prepare_job(args) -> ServeJob:
    """Every flag checked before any weights are read, as plain data."""
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "max_waiting", "nproc"):
        _at_least(args, name, 1)
    if args.kv_cache_memory is not None and not (args.kv_cache_memory > 0 and math.isfinite(args.kv_cache_memory)):
        raise UserError(f"--kv-cache-memory must be a positive number of GiB, got {args.kv_cache_memory}")
    if not 0 <= args.shutdown_grace < math.inf:
        raise UserError(f"--shutdown-grace must be a number of seconds >= 0, got {args.shutdown_grace}")
    if not 0 < args.collective_timeout < math.inf:
        raise UserError(f"--collective-timeout must be a positive number of seconds, got {args.collective_timeout}")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    api_key = _api_key(args)
    _at_least(args, "max_request_bytes", 1)
    host = check_host(args.host)
    check_counts(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 block_size=args.block_size)
    plan = check_plan(args)
    for name in ("expert_slots", "rebalance_every"):
        _at_least(args, name, 0)
    check_requested(getattr(args, "threads", 0))
    slo = check_slo(args)
    if (slo["ttft_ms"] is not None or slo["tpot_ms"] is not None) and plan.dp > 1:
        raise UserError(f"--ttft-ms/--tpot-ms with plan {plan.to_string()} is not there yet: the latency targets size "
                        "one scheduler's steps, and dp ranks each have their own (use tp=N, or pools: --pool)")
    return ServeJob(
        model=args.model, step=args.step, tokenizer=args.tokenizer, host=host, port=args.port,
        served_model_name=args.served_model_name or args.model, plan=plan, nproc=args.nproc, device=args.device,
        dtype=args.dtype or "auto", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
        max_waiting=args.max_waiting, api_key=api_key, max_request_bytes=args.max_request_bytes,
        shutdown_grace=args.shutdown_grace, collective_timeout=args.collective_timeout,
        expert_slots=args.expert_slots, rebalance_every=args.rebalance_every, expert_placement=args.expert_placement,
        generation_config=getattr(args, "generation_config", "auto"),
        chat_template=_chat_template(getattr(args, "chat_template", None)),
        tool_call_parser=getattr(args, "tool_call_parser", None), threads=getattr(args, "threads", 0),
        max_restarts=max_restarts(args.max_restarts, args.nproc), max_restarts_given=args.max_restarts,
        speculative=SpeculativeConfig.parse(getattr(args, "speculative_config", None)),
        compile=getattr(args, "compile", False), **slo)


def _chat_template(path: str | None) -> str | None:
    if path is not None:
        ChatTemplate(None, path)  # UserError: unreadable, or not a template
    return path


def _api_key(args) -> str | None:
    """The key from --api-key, --api-key-file or $PHALANX_API_KEY (one of them)."""
    given = [name for name, value in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file)) if value is not None]
    if len(given) > 1:
        raise UserError("give the API key once: --api-key or --api-key-file")
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as file:
                key = file.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"--api-key-file {args.api_key_file}: {getattr(error, 'strerror', None) or error}") from None
        if not key.strip():
            raise UserError(f"--api-key-file {args.api_key_file}: its first line is empty")
        return key
    if args.api_key is None:
        key = os.environ.get(KEY_ENV)
        if key is not None and not key.strip():
            raise UserError(f"${KEY_ENV} is set but empty")
        return key
    if not args.api_key.strip():
        raise UserError("--api-key is empty")
    return args.api_key


def check_host(host: str) -> str:
    """--host: an address of this machine, given explicitly ("" would bind every interface,
    as an unset shell variable could say without meaning to)."""
    if not host.strip():
        raise UserError("--host is empty: give an address (127.0.0.1: this machine only; 0.0.0.0: every interface)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except (OSError, UnicodeError) as error:
        raise UserError(f"--host {host} is not an address of this machine: {getattr(error, 'strerror', None) or error}") from None
    return host


def check_plan(args) -> Plan:
    """The layouts serving runs: tp=N; dp=N,ep=N (attention data parallelism, every dp rank an
    expert rank); tp=N,ep=M,ep_over_tp=true (experts over the tp ranks)."""
    world_size = int(os.environ.get("WORLD_SIZE", args.nproc))
    plan = plan_from_string(args.plan or f"tp={world_size}", world_size)
    ep_beside_tp = plan.ep > 1 and plan.tp > 1 and not plan.ep_over_tp
    if plan.pp > 1 or plan.cp > 1 or plan.sp or plan.zero or (plan.dp > 1 and plan.tp > 1) or ep_beside_tp:
        raise UserError(f"phalanx serve runs tp=N, dp=N,ep=N and tp=N,ep=M,ep_over_tp=true; plan {plan.to_string()} "
                        "(pp, cp, sp, zero, or dp beside tp) is not there yet (docs/serve.md)")
    if plan.dp > 1 and plan.ep != plan.dp:
        raise UserError(f"phalanx serve runs attention data parallelism as dp=N,ep=N (every rank an expert rank); "
                        f"plan {plan.to_string()} has dp={plan.dp}, ep={plan.ep}: not there yet (docs/serve.md)")
    return plan


def check_mtp(job: ServeJob, source) -> None:
    """--speculative-config deepseek_mtp: a DeepSeek-V3 checkpoint with its multi-token-prediction
    layer, served by one process (the draft step runs on rank 0's model and cache alone)."""
    # Imported here, not at the top: it reaches torch, and `serve --help` should start light.
    from phalanx.hf.mtp_weights import mtp_layers

    mtp_layers(source.weights_dir, source.is_run)
    if job.plan.world_size > 1:
        raise UserError(f"--speculative-config deepseek_mtp with plan {job.plan.to_string()} is not there yet: the "
                        "draft step runs in one process (serve without --plan/--nproc)")


def check_for_model(job: ServeJob) -> None:
    """Before any worker starts: the plan's tp and ep and the expert-slot flags against the model."""
    # Imported here, not at the top: they reach torch, and `serve --help` should start light.
    from phalanx.serve.expert_placement import first_placement

    source = resolve_model(job.model, job.step)
    cfg, plan = source.cfg, job.plan
    if job.speculative is not None and job.speculative.drafts_with_model:
        check_mtp(job, source)
    # The trainer's rule, as serving shards the model with the same apply_tp: a tp that does
    # not divide the KV heads would fail in the first forward, after the server is up.
    if problems := validate_tp(plan, cfg, cfg.max_seq_len):
        raise UserError(f"invalid plan: {problems[0]}")
    if problem := rules.ep_problem(plan.ep, dp=plan.dp, n_experts=cfg.n_experts, model=cfg.name, tp=plan.tp,
                                   over_tp=plan.ep_over_tp):
        raise UserError(f"invalid plan: {problem}")
    first_placement(job, cfg, plan)
