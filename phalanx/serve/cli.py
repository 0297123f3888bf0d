"""`phalanx serve`: an OpenAI-compatible HTTP server over a model directory or a run.

Importing this module does not import torch, uvicorn or starlette (`phalanx serve --help`
stays cheap); the command does.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import sys

from phalanx.errors import UserError
from phalanx.serve.job import (DEFAULT_MAX_REQUEST_BYTES, ServeJob, check_for_model, prepare_job, slo_policy,
                               slo_targets)
from phalanx.serve.tool_call_parsers import PARSERS
from phalanx.thread_tuner import ThreadTuner
from phalanx.threads import SERVER_RESERVED_CORES, choose_for_this_process

DEFAULTS = {"host": "127.0.0.1", "port": 8000, "max_num_seqs": 32, "max_num_batched_tokens": 512, "block_size": 16,
            "max_waiting": 256, "shutdown_grace": 30.0, "collective_timeout": 600.0}
STARTUP_TIMEOUT_S = 600.0
"""The process group's timeout while the ranks load their weights (at least): loading reads
checkpoints at each rank's own pace, which is not a collective inside a step; the group is
bound to --collective-timeout once every rank has its model."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Continuous batching over a paged KV cache, behind /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health and /metrics (docs/serve.md).")
    add = parser.add_argument
    add("--model", required=True, help="Hugging Face model directory (with weights), or a run directory of phalanx train")
    add("--step", type=int, default=None, help="with a run directory: the checkpoint of this step (default: the newest)")
    add("--tokenizer", default="", help="tokenizer.json or 'bytes' (default: the model directory's tokenizer.json, else bytes)")
    add("--host", default=DEFAULTS["host"], help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0: "
                                                 "every interface)")
    add("--port", type=int, default=DEFAULTS["port"], help="port (default 8000; 0: a free one, printed)")
    add("--served-model-name", default="", help="the model's name in the API (default: --model as given)")
    add("--max-num-seqs", type=int, default=DEFAULTS["max_num_seqs"],
        help=f"most sequences in one step's batch (default {DEFAULTS['max_num_seqs']})")
    add("--max-num-batched-tokens", type=int, default=DEFAULTS["max_num_batched_tokens"],
        help=f"most tokens one step feeds the model; longer prompts are prefilled in chunks (default {DEFAULTS['max_num_batched_tokens']})")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                        help="GiB of KV cache (default: 1 on CPU, 90%% of the GPU memory left after the weights)")
    memory.add_argument("--num-kv-blocks", type=int, default=None, metavar="N", help="KV cache blocks, instead of --kv-cache-memory")
    add("--block-size", type=int, default=DEFAULTS["block_size"], help=f"positions per KV block (default {DEFAULTS['block_size']})")
    add("--api-key", default=None, help="require Authorization: Bearer KEY on every /v1 request (visible to other "
                                        "users in ps: prefer --api-key-file or PHALANX_API_KEY)")
    add("--api-key-file", default=None, metavar="PATH", help="the API key, read from this file's first line")
    add("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
        help=f"largest request body (default {DEFAULT_MAX_REQUEST_BYTES} = 4 MiB; larger: 413)")
    add("--dtype", choices=("fp32", "bf16"), default=None, help="weights and cache dtype (default: fp32 on CPU, bf16 on GPU)")
    add("--generation-config", choices=("auto", "vllm"), default="auto",
        help="auto: the model's generation_config.json fills the sampling fields a request leaves out (temperature, "
             "top_p, top_k, min_p, repetition_penalty); vllm: vLLM's own defaults (default auto, as vLLM)")
    add("--chat-template", default=None, metavar="FILE",
        help="a jinja chat template to use instead of the model's own (chat_template.jinja or tokenizer_config.json)")
    add("--speculative-config", default=None, metavar="JSON",
        help='speculative decoding, vLLM\'s form: \'{"method": "ngram", "num_speculative_tokens": 4}\' guesses up to 4 '
             "tokens a step from earlier text (prompt_lookup_max, prompt_lookup_min: the n-gram lengths tried); "
             '"deepseek_mtp" drafts them with DeepSeek-V3\'s multi-token-prediction layer (default none; docs/serve.md)')
    add("--tool-call-parser", choices=tuple(PARSERS), default=None,
        help="the format tool_choice auto reads the model's tool calls in: hermes (<tool_call> JSON, Qwen's) or "
             "llama3_json (Llama 3's JSON objects) (default: as the chat template shows it)")
    add("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto, cpu or cuda")
    add("--max-waiting", type=int, default=DEFAULTS["max_waiting"],
        help=f"most requests waiting for a seat; more get 429 (default {DEFAULTS['max_waiting']})")
    add("--shutdown-grace", type=float, default=DEFAULTS["shutdown_grace"],
        help=f"seconds running requests may take to finish after SIGTERM or Ctrl-C (default {DEFAULTS['shutdown_grace']:g})")
    add("--nproc", type=int, default=1, help="local worker processes (default 1)")
    add("--compile", action="store_true",
        help="decode steps through one torch.compile'd graph (CPU, float32, dense models; the first decode compiles, "
             "tens of seconds; docs/serve.md)")
    add("--threads", type=int, default=0, metavar="N", help="torch intra-op threads per process (default 0: OMP_NUM_THREADS if set, else the cores this process may use divided among the local processes; docs/serve.md)")
    add("--plan", default="", help="parallel layout: tp=N, dp=N,ep=N (attention data parallelism, experts over the "
                                   "ranks) or tp=N,ep=N,ep_over_tp=true (default: one process)")
    add("--collective-timeout", type=float, default=DEFAULTS["collective_timeout"], metavar="SECONDS",
        help="with --nproc N: seconds a collective inside a step may wait for the other ranks before the server "
             f"counts a rank as lost and restarts them (default {DEFAULTS['collective_timeout']:g}; idle ranks "
             "exchange heartbeats, so idling is not bounded by it)")
    add("--max-restarts", type=int, default=None, metavar="N",
        help="with --nproc N: start the ranks again this many times after one dies (default 3 with several "
             "processes)")
    _add_expert_flags(add)
    _add_slo_flags(add)
    _add_pool_flags(add)
    parser.set_defaults(func=_run, serve_parser=parser)


def _add_slo_flags(add) -> None:
    add("--ttft-ms", type=float, default=None, metavar="X",
        help="time-to-first-token target: a request that cannot meet it is refused at arrival (429)")
    add("--tpot-ms", type=float, default=None, metavar="Y",
        help="time-per-output-token target: each step's batch and prefill chunk are sized to keep running requests within it")


def _add_pool_flags(add) -> None:
    add("--pool", action="append", default=None, metavar="NAME:PLAN",
        help="a pool of ranks in its own layout for one request class (repeat: --pool latency:tp=2 "
             "--pool throughput:tp=1), or auto: the serving planner splits --nproc ranks for --ttft-ms/--tpot-ms; "
             "requests pick theirs by X-Phalanx-Class or service_tier")
    add("--pool-move-after", type=float, default=10.0, metavar="S",
        help="seconds one pool idles while another queues past its target before ranks move to it (default 10)")
    add("--isl", type=int, default=None, metavar="TOKENS",
        help="with --pool auto: prompt tokens per request to plan for (default 512, or 4/5 of a shorter model's positions)")
    add("--osl", type=int, default=None, metavar="TOKENS",
        help="with --pool auto: output tokens per request to plan for (default 128, or the rest of the positions)")


def _run(args) -> int:
    job = prepare_job(args)
    if not getattr(args, "pool", None) and (args.isl is not None or args.osl is not None):
        raise UserError("--isl/--osl are the lengths --pool auto plans for; give them with --pool auto")
    if getattr(args, "pool", None):
        # Imported when run, not at the top: the command's own code, which start-up need not load.
        from phalanx.serve.pool_main import run_pools

        return run_pools(args, job)
    if "RANK" not in os.environ:
        check_for_model(job)
    if ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or job.nproc == 1:
        return worker_main(job)
    return _launch(job)


def _launch(job: ServeJob) -> int:
    """`--nproc N`: N local workers, started again after one dies, by the one launcher of every
    command and its restart policy (phalanx/launch/worker_launch.py, phalanx/launch/restart_policy.py).

    A rank that dies (SIGKILL, a crash, a collective past `--collective-timeout`) breaks the
    group: rank 0 answers every request 503 and exits (`launch/rank_loop.py`), the agent stops the
    others, and all ranks start again on the same port (a `--port 0` is resolved to a free port
    once, before the first start, so that clients find the restarted server where the first
    one was). SIGTERM to this process reaches every rank (rank 0 drains, the others wait for
    it) and ends with 0, Ctrl-C with 130; with no restarts left, 1 and one line saying why."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.ports import free_port
    from phalanx.launch.restart_policy import STOP_STATUS
    from phalanx.worker_group import check_nproc
    from phalanx.launch.worker_launch import launch_workers

    check_nproc(job.nproc, job.device)
    if job.port == 0 and job.max_restarts:
        job = dataclasses.replace(job, port=free_port())
    status = launch_workers(worker_main, lambda attempt: (job,), job.nproc, job.device, job.max_restarts,
                            restarting=lambda: "restarting the server's ranks", grace_s=int(job.shutdown_grace) + 15,
                            run_id=f"phalanx-serve-{os.getpid()}", who=lambda rank: f"rank {rank} of the server")
    return 0 if status == STOP_STATUS[signal.SIGTERM] else status  # a stop by SIGTERM, done gracefully


def worker_main(job: ServeJob) -> int:
    """Every rank: rank 0 serves (HTTP, scheduler, sampling), the others follow its forwards."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.worker_group import run_in_group

    startup = datetime.timedelta(seconds=max(job.collective_timeout, STARTUP_TIMEOUT_S))
    status = run_in_group(job.device, lambda: _rank_main(job), timeout=startup, threads=job.threads,
                          reserved=SERVER_RESERVED_CORES, say=False)
    return 2 if status is None else status


def _rank_main(job: ServeJob) -> int:
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch.distributed as dist

    from phalanx.inference.generation_config import sampling_defaults
    from phalanx.inference.model_source import resolve_model, text_codec

    source = resolve_model(job.model, job.step)
    parallel = dist.is_initialized() and dist.get_world_size() > 1
    if parallel and dist.get_rank() != 0:
        # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
        from phalanx.launch.rank_loop import follow

        return follow(build_engine(job, source).runner)
    codec = text_codec(source.tokenizer_dir, job.tokenizer or source.tokenizer)
    defaults = sampling_defaults(source.tokenizer_dir) if job.generation_config == "auto" else {}
    # Imported when run, not at the top: it brings in prometheus_client, starlette, torch, uvicorn, which start-up need not wait for.
    from phalanx.serve.chat_template import ChatTemplate
    from phalanx.serve.metrics import ServeMetrics
    from phalanx.launch.rank_loop import RankChannel, heartbeat_interval
    from phalanx.serve.server import serve
    from phalanx.worker_group import say_threads

    cfg = source.cfg
    channel = RankChannel(heartbeat_interval(job.collective_timeout)) if parallel else None
    metrics = ServeMetrics(moe=cfg.n_experts > 0, slo=slo_targets(job))

    def loaded_engine():
        engine = build_engine(job, source, channel, metrics)
        say_threads(job.threads, SERVER_RESERVED_CORES)  # once the model is in: a failed start stays one error line
        return engine

    chat_template = ChatTemplate(source.tokenizer_dir, job.chat_template, job.tool_call_parser)
    return serve(job, loaded_engine, codec, chat_template, metrics, cfg.max_seq_len, cfg.vocab_size, defaults)


def build_engine(job: ServeJob, source, channel=None, metrics=None):
    """The model (this rank's part), the block pool sized for it, the scheduler(s), the engine.
    `metrics`: rank 0's, which counts live expert rebalances."""
    # Imported when run, not at the top: it brings in numpy, torch, which start-up need not wait for.
    import torch.distributed as dist

    from phalanx.local_device import pick_device
    from phalanx.parallel.mesh import build_mesh
    from phalanx.scheduling.scheduler import Scheduler
    from phalanx.serve.engine import Engine
    from phalanx.serve.expert_placement import first_placement, slot_placements
    from phalanx.serve.loading import kv_blocks, load_serving_model, pick_dtype

    device = pick_device(job.device)
    dtype = pick_dtype(job.dtype, device)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    plan = job.plan
    mesh = build_mesh(plan, device)
    phy2log = first_placement(job, source.cfg, plan)
    slots = None if phy2log is None else slot_placements(phy2log, source.cfg, plan.ep)
    model = load_serving_model(source, mesh, dtype, slots)
    num_blocks = kv_blocks(job, source.cfg, plan.tp, device, dtype, agree=world_size > 1)
    if world_size > 1:  # every rank has its model: from here a collective is a step's (STARTUP_TIMEOUT_S)
        from phalanx.worker_group import bound_every_group

        bound_every_group(job.collective_timeout)

    def scheduler() -> Scheduler:
        # Preempted sequences wait too: the bound on new requests is the engine loop's.
        return Scheduler(num_blocks=num_blocks, block_size=job.block_size, max_num_seqs=job.max_num_seqs,
                         max_num_batched_tokens=job.max_num_batched_tokens,
                         max_waiting=job.max_waiting + job.max_num_seqs, slo=slo_policy(job),
                         speculative=job.speculative)

    mtp = _mtp_layer(job, source, device, dtype, world_size)
    if plan.dp == 1:
        return Engine(model, scheduler(), device, channel=channel, expert_ranks=plan.ep, compile=job.compile,
                      tuner=thread_tuner(job, world_size, device), mtp=mtp)
    # Imported when run, not at the top: it brings in numpy, torch, which start-up need not wait for.
    from phalanx.serve.dp_assign import DPSchedulers
    from phalanx.serve.dp_engine import DPEngine
    from phalanx.serve.expert_placement import LivePlacement

    if job.compile:
        print("phalanx: --compile: decodes stay eager: experts over data-parallel ranks are not compiled",
              file=sys.stderr, flush=True)
    rank = dist.get_rank()
    live = None if phy2log is None else LivePlacement(model, phy2log, source.cfg.n_experts, plan.ep,
                                                     job.rebalance_every, planner=rank == 0)
    schedulers = DPSchedulers([scheduler() for _ in range(plan.dp if rank == 0 else 1)])
    return DPEngine(model, schedulers, device, dp_rank=mesh.axis_rank("dp"), channel=channel, expert_ranks=plan.ep,
                    placement=live, on_rebalance=None if metrics is None else metrics.rebalanced)


def _mtp_layer(job: ServeJob, source, device, dtype, world_size: int):
    """The checkpoint's multi-token-prediction layer for `--speculative-config` deepseek_mtp, else None."""
    if job.speculative is None or not job.speculative.drafts_with_model:
        return None
    if world_size > 1:  # a pool's instances reach here without the start-up check (job.check_mtp)
        raise UserError(f"--speculative-config deepseek_mtp runs in one process; this server has {world_size} ranks")
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.cpu_ops.onednn_linear import use_onednn
    from phalanx.hf.mtp_weights import load_multi_token_prediction

    mtp = load_multi_token_prediction(source.weights_dir, source.cfg, device, dtype)
    use_onednn(mtp)  # as the model's own matrices on CPU
    return mtp


def thread_tuner(job: ServeJob, world_size: int, device) -> ThreadTuner | None:
    """A single CPU process whose thread count is automatic re-decides it from its steps' speed
    (thread_tuner.py); None where the user set the count, ranks run in lockstep, or the model
    runs on a GPU (its steps' time is not the CPU threads')."""
    choice = choose_for_this_process(job.threads, reserved=SERVER_RESERVED_CORES)
    if world_size > 1 or device.type != "cpu" or not choice.automatic or choice.threads < 2:
        return None
    return ThreadTuner(choice.threads)


def _add_expert_flags(add) -> None:
    """Live wide expert parallelism (`--plan dp=N,ep=N`): docs/serve.md."""
    add("--expert-slots", type=int, default=0, metavar="S",
        help="expert slots per MoE layer over the ep ranks (>= experts, a multiple of ep): hot experts get "
             "replicas (default 0: one slot per expert)")
    add("--rebalance-every", type=int, default=0, metavar="K",
        help="re-place experts from the measured loads every K engine steps, moving weights between ranks "
             "while serving (default 0: never)")
    add("--expert-placement", default="", metavar="RUN_DIR",
        help="start from the placement for the expert loads a phalanx train run recorded (its metrics.jsonl)")
