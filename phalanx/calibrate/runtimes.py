"""Framework costs of the trainer's data-parallel and pipeline runtimes on a CPU, beyond the
FLOPs, bytes and collectives the cost model already charges (`phalanx calibrate` calls these).

On a CPU the ranks' compute threads keep every core busy, so a collective issued from a hook
(DDP's bucket all-reduce) or a pipeline send/receive waits for the scheduler as well as for
the wire; the alpha-beta fits of idle-machine collectives do not see that. Each figure here
is timed on the trainer's own code path against the same work without it:

  tp step             phalanx's apply_tp with sp against the bare model, with the trainer's
                       vocabulary-parallel loss, clipping and AdamW, at 0, 1 and 9 blocks: the
                       per-micro-batch cost beyond the layers (0 blocks) and the optimizer's
                       per-layer cost on DTensors (slope over 1 -> 9);
  fsdp per group size  FSDP2 per block (calibrate's `_fsdp_worker`) at every group size;
  ddp_step_overhead    DDP (as `apply_ddp` wraps it) against the bare model, forward+backward, per group
                       size: the median extra per step (the cost is scheduling waits, which
                       a step pays typically, not at its best), less the gradient all-reduce's
                       alpha-beta time, which the cost model charges already;
  fsdp under pp        FSDP2 as the trainer wraps it under pipeline parallelism, per group size (HSDP with
                       shard size 1, `reshard_after_forward=False`, the gradient reduction
                       and the reshard only after the last micro-batch, as PyTorch's pipeline
                       stage drives it) at 1 and 5 blocks and 1 and 3 micro-batches: the cost
                       per unit per step and per unit per micro-batch;
  pipeline actions     phalanx's pipeline step (`parallelize`, `make_pipeline`,
                       `pipeline_step`) on 2 stages for 1f1b, interleaved, zbv and dualpipev,
                       at 4 and 8 micro-batches of 16 tokens: the growth per micro-batch less
                       the rank's own chunks' forward and backward timed outside the schedule,
                       per action (`cost.actions_per_microbatch`: a forward and a backward per
                       chunk, the V schedules' backward split in two).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time

from phalanx.calibrate.compute import OVERHEAD_MODEL, OVERHEAD_TOKENS, overhead_model
from phalanx.calibrate.fit import all_reduce_s, fit_fsdp_pp, fit_split_rerun, fit_tp_step
from phalanx.calibrate.workers import init_worker, run_workers, smoke
from phalanx.calibrate.wrappers import fsdp_worker
from phalanx.model.config import ModelConfig
from phalanx.plan import Plan, parse_plan
from phalanx.planner.cost import actions_per_microbatch
from phalanx.planner.stage_time import weight_tensors

PP_TOKENS = (1, 16)
"""(micro-batch, sequence) of the pipeline measurement: small, so the runtime's cost shows."""


DDP_TOKENS = (4, 128)
"""(micro-batch, sequence) of the DDP measurement: a real micro-batch, whose backward the
bucket all-reduce competes with for the cores."""


def _ddp_worker(rank: int, world: int, port: int, repeats: int, threads: int, queue) -> None:
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.model.transformer import Transformer

    torch, dist = init_worker(rank, world, port, threads)
    cfg = overhead_model(2, DDP_TOKENS[1])
    torch.manual_seed(0)
    bare = Transformer(cfg)
    torch.manual_seed(0)
    wrapped = torch.nn.parallel.DistributedDataParallel(Transformer(cfg))
    tokens = torch.randint(0, cfg.vocab_size, DDP_TOKENS)
    extra = []
    for i in range(repeats + 2):  # alternate, so that drift on a shared machine hits both alike
        times = []
        for model in (bare, wrapped):
            dist.barrier()
            start = time.perf_counter()
            model(tokens).sum().backward()
            times.append(time.perf_counter() - start)
        if i >= 2:
            extra.append(times[1] - times[0])
    if rank == 0:
        queue.put({"extra_s": statistics.median(extra), "grad_bytes": 4.0 * sum(p.numel() for p in bare.parameters())})
    dist.destroy_process_group()


def _fsdp_pp_worker(rank: int, world: int, port: int, repeats: int, threads: int, queue) -> None:
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from phalanx.model.transformer import Transformer

    torch, dist = init_worker(rank, world, port, threads)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    tiny = dict(dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, max_seq_len=16)

    def step(model, tokens, microbatches: int, wrapped: bool) -> None:
        for i in range(microbatches):
            last = i == microbatches - 1
            if wrapped:  # what torch.distributed.pipelining's stage sets around each backward
                model.set_is_last_backward(last)
                model.set_reshard_after_backward(last)
                model.set_requires_gradient_sync(last)
            model(tokens).sum().backward()

    result = {}
    for layers in (1, 5):
        cfg = ModelConfig(name="fsdp-pp", n_layers=layers, **tiny)
        tokens = torch.randint(0, cfg.vocab_size, (1, 8))
        models = []
        for wrapped in (False, True):
            torch.manual_seed(0)
            model = Transformer(cfg)
            if wrapped:
                for block in model.layers.values():
                    fully_shard(block, mesh=mesh, reshard_after_forward=False)
                fully_shard(model, mesh=mesh, reshard_after_forward=False)
            models.append(model)
        for microbatches in (1, 3):
            best = []
            for wrapped, model in zip((False, True), models):
                samples = []
                for i in range(repeats + 2):
                    dist.barrier()
                    start = time.perf_counter()
                    step(model, tokens, microbatches, wrapped)
                    if i >= 2:
                        samples.append(time.perf_counter() - start)
                best.append(min(samples))
            result[f"{layers}:{microbatches}"] = best[1] - best[0]
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def _tp_step_worker(rank: int, world: int, port: int, repeats: int, threads: int, queue) -> None:
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from torch.distributed.device_mesh import init_device_mesh

    from phalanx.model.transformer import Transformer
    from phalanx.parallel.grad_norm import clip_grad_norm
    from phalanx.parallel.tensor_parallel import apply_tp, loss_context
    from phalanx.train.loss import token_loss

    torch, dist = init_worker(rank, world, port, threads)
    mesh = init_device_mesh("cpu", (world,))
    (b, s) = OVERHEAD_TOKENS[1]
    tokens = torch.randint(0, OVERHEAD_MODEL.get("vocab_size", 256), (b, s))
    best: dict = {}
    for _ in range(1 if smoke() else 2):  # two rounds, each timing's best (see calibrate.measure_overheads)
        for layers in (1, 9):  # the intercept at 0: embedding, output and loss alone
            for tp in (False, True):
                torch.manual_seed(0)
                model = Transformer(ModelConfig(name="tp-step", n_layers=layers, max_seq_len=s, **OVERHEAD_MODEL))
                if tp:
                    apply_tp(model, mesh, sp=True)
                plan = Plan(tp=world, sp=True) if tp else Plan()
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
                steps, tails = [], []
                for i in range(repeats + 2):
                    dist.barrier()
                    start = time.perf_counter()
                    with loss_context(plan):  # the trainer's vocabulary-parallel loss under tp
                        token_loss(model(tokens), tokens).backward()
                    middle = time.perf_counter()
                    clip_grad_norm(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if i >= 2:
                        steps.append(middle - start)
                        tails.append(time.perf_counter() - middle)
                for key, samples in (("step", steps), ("tail", tails)):
                    best[(key, layers, tp)] = min(best.get((key, layers, tp), math.inf), *samples)
    if rank == 0:
        queue.put({f"{key}:{layers}:{int(tp)}": t for (key, layers, tp), t in best.items()})
    dist.destroy_process_group()


PP_SCHEDULES = ("1f1b", "interleaved", "zbv", "dualpipev")
"""The schedules whose runtime cost is measured (gpipe runs 1f1b's actions)."""


def _pp_worker(rank: int, world: int, port: int, repeats: int, threads: int, queue) -> None:
    # Imported when run, not at the top: it brings in numpy, torch, which start-up need not wait for.
    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.mesh import build_mesh
    from phalanx.train.loss import token_loss
    from phalanx.train.pipeline_step import make_pipeline, pipeline_step

    torch, dist = init_worker(rank, world, port, threads)
    mbs, seq = PP_TOKENS
    device = torch.device("cpu")

    def per_microbatch(plan_text: str, cfg) -> tuple[float, object]:
        """Growth of the fastest step per micro-batch, from 2 to 4 per stage; and the model."""
        steps = {}
        for microbatches in (2 * world, 4 * world):
            plan = parse_plan(f"{plan_text},microbatches={microbatches}")[0]
            mesh = build_mesh(plan, device)
            model = parallelize(cfg, mesh, seed=0, seq_len=seq, microbatch_tokens=mbs * seq)
            pipeline = make_pipeline(model, mesh)
            tokens = torch.randint(0, cfg.vocab_size, (microbatches * mbs, seq))
            samples = []
            for i in range(repeats + 2):
                dist.barrier()
                start = time.perf_counter()
                pipeline_step(pipeline, mesh, tokens, tokens, autocast=contextlib.nullcontext)
                if i >= 2:
                    samples.append(time.perf_counter() - start)
            steps[microbatches] = min(samples)
        (small, large) = sorted(steps)
        return (steps[large] - steps[small]) / (large - small), model

    result = {}
    for schedule in PP_SCHEDULES:
        virtual = 1 if schedule == "1f1b" else 2
        cfg = overhead_model(world * virtual, seq)
        per_mb, model = per_microbatch(f"pp={world},schedule={schedule},virtual={virtual}", cfg)
        # This rank's own forward and backward of one micro-batch through its chunks, outside
        # the schedule: what the cost model charges as compute.
        own = 0.0
        for chunk, index in zip(model.chunks, model.stage_indices):
            first, last = index == 0, index == world * virtual - 1
            x = (torch.randint(0, cfg.vocab_size, PP_TOKENS) if first
                 else torch.randn(mbs, seq, cfg.dim, requires_grad=True))
            local = []
            for i in range(repeats + 2):
                start = time.perf_counter()
                out = chunk(x)
                (token_loss(out, torch.zeros(mbs, seq, dtype=torch.long)) if last else out.sum()).backward()
                if i >= 2:
                    local.append(time.perf_counter() - start)
            own += min(local)
        own_t = torch.tensor([own])
        dist.all_reduce(own_t, op=dist.ReduceOp.MAX)  # the slowest rank paces the pipeline
        result[schedule] = {"rank_mb_s": float(own_t), "per_mb_s": per_mb,
                            "action_us": max(0.0, (per_mb - float(own_t)) / actions_per_microbatch(schedule, virtual)) * 1e6}
        if schedule == "zbv":
            # Full recompute under the split backward: on a rank of middle stages (one block
            # each) every block re-runs its forward once for the input gradient and once per
            # weight tensor (PyTorch takes each weight's gradient in its own autograd call).
            full, _ = per_microbatch(f"pp={world},schedule=zbv,virtual=2,recompute=full", cfg)
            block = model.chunks[-1].layers[next(iter(model.chunks[-1].layers))]
            h = torch.randn(mbs, seq, cfg.dim)
            times = []
            for i in range(repeats + 2):
                start = time.perf_counter()
                block(h, model.chunks[-1].rope)
                if i >= 2:
                    times.append(time.perf_counter() - start)
            result[schedule].update(recompute_per_mb_s=full - per_mb, block_forward_s=min(times),
                                    reruns_per_mb=virtual * (1 + weight_tensors(cfg, moe=False)))
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def measure_runtime_overheads(*, max_procs: int, collective_fits: dict, quick: bool, log=print) -> dict:
    """The Cluster fields of this module's measurements (us or ms, before the machine-share
    scaling that `calibrate` applies to every fixed cost)."""
    repeats = 1 if smoke() else 4 if quick else 12
    run = lambda worker, world, what: run_workers(  # noqa: E731
        worker, world, (repeats, max(1, (os.cpu_count() or 1) // world)), start_method="fork", timeout_s=180.0,
        what=f"{what} measurement on {world} gloo processes")

    ddp, fsdp, fsdp_pp = [], [], []
    for world in range(2, max(2, max_procs) + 1):
        # FSDP per group size too: its three collectives per unit wait for busy cores, more so
        # with more processes than cores (about 5x from 2 to 4 processes on 2 cores here, not
        # the 2x of sharing the cores; docs/planner.md has a run's figures).
        fsdp.append((world, run(fsdp_worker, world, "FSDP")["overhead_us"]))
        under_pp = fit_fsdp_pp(run(_fsdp_pp_worker, world, "FSDP-under-pipeline"))
        fsdp_pp.append((world, under_pp["fsdp_pp_unit_overhead_us"], under_pp["fsdp_pp_microbatch_overhead_us"]))
        sample = run(_ddp_worker, world, "DDP")
        fit = collective_fits.get(world)  # the gradient all-reduce the cost model charges on its own
        wire = all_reduce_s(fit, world, sample["grad_bytes"]) if fit else 0.0
        ddp.append((world, max(0.0, sample["extra_s"] - wire) * 1e3))
    tp_step = fit_tp_step(run(_tp_step_worker, 2, "tensor-parallel step"))
    pp = run(_pp_worker, 2, "pipeline")
    actions = tuple((schedule, pp[schedule]["action_us"]) for schedule in PP_SCHEDULES)
    split_rerun = fit_split_rerun(pp["zbv"])
    log("FSDP adds " + ", ".join(f"{us:.0f} us per unit per micro-batch at {w} processes" for w, us in fsdp)
        + "; DDP adds " + ", ".join(f"{ms:.2f} ms per step at {w} processes" for w, ms in ddp)
        + " beyond its all-reduce; FSDP under pp " + ", ".join(
            f"{unit:.0f} us per unit per step + {mb:.0f} us per unit per micro-batch at {w} processes"
            for w, unit, mb in fsdp_pp) + "; the pipeline runtime "
        + ", ".join(f"{us:.0f} us per action under {s}" for s, us in actions)
        + f"; a split-backward recompute costs {split_rerun:.0f} us per re-run beyond its forward; tensor "
        f"parallelism {tp_step['tp_microbatch_overhead_us']:.0f} us per micro-batch (embedding, output, "
        f"vocabulary-parallel loss) and {tp_step['tp_optimizer_layer_overhead_us']:.0f} us per layer per step "
        "(clipping, AdamW, zeroing on DTensors)")
    return {"ddp_step_overhead_ms": tuple(ddp), "fsdp_unit_overhead_groups": tuple(fsdp),
            "fsdp_pp_overhead_groups": tuple(fsdp_pp),
            "fsdp_pp_unit_overhead_us": fsdp_pp[0][1], "fsdp_pp_microbatch_overhead_us": fsdp_pp[0][2],
            "pp_action_overhead_us": actions, "split_rerun_overhead_us": split_rerun, **tp_step}
