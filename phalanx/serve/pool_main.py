"""`phalanx serve --pool NAME:PLAN [--pool ...]`: the flags checked, then the front
(`pool_server.py`) on uvicorn with every pool's instances started beside it.

Every flag but --pool, --pool-move-after, --isl, --osl, --host, --port, --nproc and --plan is passed
on to each instance, so an instance is what `phalanx serve --nproc N --plan PLAN` with the same flags
is. `--pool auto --nproc N` takes the pools from the serving planner (pool_auto.py).
"""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace

from phalanx import layout_rules as rules
from phalanx.errors import UserError
from phalanx.inference.model_source import is_run_dir, resolve_model
from phalanx.model.hf_config import read_model_config
from phalanx.plan import plan_from_string
from phalanx.plan_model_checks import validate_tp
from phalanx.process_count import check_process_count, usable_cores
from phalanx.planner.hardware import cluster_from_name
from phalanx.planner.serve.rates import ServeLoad
from phalanx.serve.job import ServeJob
from phalanx.serve.job import check_plan as check_serve_plan
from phalanx.serve.pool_auto import auto_split, check_auto, planned_lengths
from phalanx.serve.pool_router import Router, parse_pools

FRONT_ONLY = {"pool", "pool_move_after", "isl", "osl", "host", "port", "nproc", "plan", "func", "serve_parser",
              "command", "api_key", "api_key_file"}
"""Not passed on as flags; the API key reaches the instances in their environment
(job.KEY_ENV), never on a command line that `ps` shows every user."""


def instance_flags(args, parser) -> list[str]:
    """The command-line flags (as given, defaults left out) every instance shares."""
    flags: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in FRONT_ONLY or action.dest == "help":
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        option = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if action.nargs == 0:
            flags.append(option)
        else:
            for item in value if isinstance(value, list) else [value]:
                flags += [option, str(item)]
    return flags


def check_pools(args, job: ServeJob):
    """The pools as specs, every layout checked against `phalanx serve`'s rules and the model's
    shape before anything starts."""
    auto = args.pool == ["auto"]
    if args.plan or (args.nproc != 1 and not auto):
        raise UserError("--pool sets each pool's layout and ranks; drop --nproc and --plan "
                        "(--pool auto takes --nproc N, the ranks it splits)")
    if not auto and (args.isl is not None or args.osl is not None):
        raise UserError("--isl/--osl are the lengths --pool auto plans for; named pools do not use them")
    if not args.pool_move_after > 0:
        raise UserError(f"--pool-move-after must be > 0 seconds, got {args.pool_move_after}")
    specs = [] if auto else parse_pools(args.pool)  # the flags' own spelling first, then the model
    _check_ranks(args.nproc if auto else sum(spec.world * spec.instances for spec in specs), job.device,
                 "--nproc" if auto else "the pools' ranks", auto)
    if auto:
        check_auto(ttft_ms=job.ttft_ms, tpot_ms=job.tpot_ms, ranks=args.nproc)  # before the model is read
    cfg = _model_config(job)

    def check_plan(plan: str, world: int) -> None:
        check_serve_plan(SimpleNamespace(plan=plan, nproc=world))
        parsed = plan_from_string(plan, world)
        if problems := validate_tp(parsed, cfg, cfg.max_seq_len):  # as a single server checks (job.check_for_model)
            raise UserError(f"--pool ...:{plan}: {problems[0]}")
        if problem := rules.ep_problem(parsed.ep, dp=parsed.dp, n_experts=cfg.n_experts, model=cfg.name, tp=parsed.tp,
                                       over_tp=parsed.ep_over_tp):
            raise UserError(f"--pool ...:{plan}: {problem}")

    for spec in specs:
        check_plan(spec.plan, spec.world)
    if auto:
        specs = _plan_auto(args, job, cfg, layout_ok(check_plan))
    return specs, check_plan


def _check_ranks(ranks: int, device: str, what: str, auto: bool = False) -> None:
    """Every rank is a process (and a GPU, on GPUs): against this machine's, before the
    planner or any instance starts. `--pool auto` divides the machine's own ranks, so on the
    CPU its --nproc is at most the cores this process may use: every instance it plans loads
    the model and its KV cache, and ranks beyond the cores would only time-slice them (named
    pools, a layout the user wrote, keep the general process bound)."""
    check_process_count(ranks, what)
    if device == "cuda" or (device == "auto" and _cuda()):
        # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
        import torch

        if ranks > torch.cuda.device_count():
            raise UserError(f"{what} {ranks}: this machine has {torch.cuda.device_count()} GPUs")
    elif auto and ranks > usable_cores():
        raise UserError(f"{what} {ranks}: --pool auto on the CPU plans at most one rank per core, and this process "
                        f"may use {usable_cores()} cores")


def layout_ok(check_plan):
    """`check_plan` as a yes/no: whether the model runs in a layout."""
    def ok(plan: str) -> bool:
        try:
            check_plan(plan, plan_from_string(plan).world_size)
            return True
        except UserError:
            return False
    return ok


def _plan_auto(args, job: ServeJob, cfg, layout_ok) -> list:
    """`--pool auto`: the planner's two pools for the targets, each printed with why."""
    # Imported when run, not at the top: it brings in h11, prometheus_client, starlette, which start-up need not wait for.
    from phalanx.serve.pool_server import log

    isl, osl = planned_lengths(cfg, args.isl, args.osl)
    load = ServeLoad(isl=isl, osl=osl, ttft_ms=job.ttft_ms, tpot_ms=job.tpot_ms)
    cluster = cluster_from_name("local")
    gpu = job.device == "cuda" or (job.device == "auto" and _cuda())
    # As phalanx serve runs: fp32 on the CPU, bf16 on a GPU, unless --dtype says.
    dtype = {"fp32": "fp32", "bf16": "bf16"}.get(job.dtype, "bf16" if gpu else "fp32")
    split = auto_split(cfg, cluster, ranks=args.nproc, load=load, max_num_seqs=job.max_num_seqs,
                       max_batch_tokens=job.max_num_batched_tokens, weight_dtype=dtype, kv_dtype=dtype,
                       layout_ok=layout_ok)
    for line in split.lines():
        log(line)
    return [split.latency.spec(), split.throughput.spec()]


def _cuda() -> bool:
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch

    return torch.cuda.is_available()


def _model_config(job: ServeJob):
    """The model's shape, without torch for a model directory."""
    if is_run_dir(job.model):

        return resolve_model(job.model, job.step).cfg

    return read_model_config(job.model)


def run_pools(args, job: ServeJob) -> int:
    specs, check_plan = check_pools(args, job)
    flags = instance_flags(args, args.serve_parser)
    return asyncio.run(_serve(job, specs, flags, check_plan, args.pool_move_after))


async def _serve(job: ServeJob, specs, flags: list[str], check_plan, move_after_s: float) -> int:
    # Imported when run, not at the top: it brings in h11, prometheus_client, starlette, torch, uvicorn, which start-up need not wait for.
    import uvicorn

    from phalanx.serve.http_limits import uvicorn_limits
    from phalanx.serve.pool_backend import BackendFailed
    from phalanx.serve.pool_server import DEFAULT_INSTANCE_RESTARTS, PoolFront, build_front_app, log
    from phalanx.serve.server import PhalanxServer

    ttft_s = job.ttft_ms / 1000 if job.ttft_ms is not None else None
    router = Router(specs, job.max_num_seqs, move_after_s, layout_ok(check_plan), ttft_s)
    front = PoolFront(router, flags, job.device, job.api_key, job.max_request_bytes,
                      restarts=DEFAULT_INSTANCE_RESTARTS if job.max_restarts_given is None else job.max_restarts_given)
    config = uvicorn.Config(build_front_app(front), host=job.host, port=job.port, log_level="warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=job.shutdown_grace + 10,
                            **uvicorn_limits())
    host = job.host
    shown = f"[{host}]" if ":" in host else host
    loop = asyncio.get_running_loop()

    # The serving line once the front listens and every pool has its instances up (as a single
    # server says it once its model is in): a supervisor waiting for it sees no false start.
    ready: dict[str, object] = {}

    def announce(**news) -> None:
        ready.update(news)
        if "port" in ready and "pools" in ready and not ready.get("said"):
            ready["said"] = True
            print(f"phalanx: serving {job.served_model_name} on http://{shown}:{ready['port']}", flush=True)

    def listening(port: int) -> None:
        announce(port=port)

    def stopping(sig: int) -> None:
        loop.create_task(front.stop_all())

    server = PhalanxServer(config, listening, stopping)
    failure: list[BaseException] = []

    async def start() -> None:
        try:
            await front.start_all()
            log(f"pools up: {front.layout()}")
            announce(pools=True)
            await front.watch()
        except BackendFailed as error:
            if not front.accepting:
                return  # stopped while the instances started: a stop, not a failure
            failure.append(error)
            log(f"error: {error}")
            server.should_exit = True

    starting = loop.create_task(start())
    try:
        await server.serve()
    finally:
        starting.cancel()
        await front.stop_all()
    if failure:
        return 1
    return 130 if server.stop_signal == signal.SIGINT else 0
