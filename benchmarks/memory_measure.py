"""Tensor memory by category of the trainer's own step, per rank (used by planner_memory.py).

The model is built as `phalanx train` builds it (`build_mesh`, `parallelize`, the pipeline
schedule, AdamW in the loop's two groups) and stepped as the loop steps it (micro-batches with
gradient sync only on the last, or the pipeline schedule; clipping; AdamW; zero_grad). PyTorch's
trackers classify every tensor storage as it is created: `FSDPMemTracker` where the rank's model
is one FSDP2 module (it tells sharded from gathered parameters and names FSDP's communication
buffers), `MemTracker` otherwise. Both only report the total at its peak, so each category's own
peak is read from the tracker's running snapshot after every operation. Two things the trackers
misplace are read directly: the optimizer state (the trackers also count AdamW's temporaries
inside `step()` as state; `optimizer_state_bytes`) and DDP's gradient buckets (allocated where
the trackers do not look; `ddp_bucket_bytes`, added to the total).
"""

from __future__ import annotations

import torch

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")

# Tracker category names -> the planner's categories; the rest (temporaries of backward, buffers,
# FSDP's all-gather and reduce-scatter buffers, inputs) count in the total only.
_TRACKER_CATEGORY = {
    "Parameter": "parameters", "Sharded Param": "parameters", "Unsharded Param": "parameters",
    "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Optstate": "optimizer_state", "OptState": "optimizer_state",
    "Activation": "activations",
}


def _step_fn(model, mesh, plan, cfg_model, *, global_batch: int, seq_len: int, dtype: str, device):
    """One optimizer step of the training loop (phalanx/train/loop.py), as a function."""
    from phalanx.parallel.data_parallel import set_gradient_sync
    from phalanx.parallel.expert import expert_params
    from phalanx.parallel.grad_norm import clip_grad_norm
    from phalanx.parallel.mixed_precision import autocast_for, release_before_step
    from phalanx.parallel.tensor_parallel import loss_context
    from phalanx.train import moe_aux_loss
    from phalanx.train.loop import batch_loss
    from phalanx.train.pipeline_step import make_pipeline, pipeline_step

    autocast = autocast_for(plan, dtype, device)  # bf16: none, the weights the forward sees are bf16
    pipeline = make_pipeline(model, mesh) if plan.pp > 1 else None
    if pipeline is not None:
        moe_aux_loss.aux_losses_in_backward(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    release_before_step(optimizer, model)  # as the loop's make_optimizer: bf16 compute copies dropped
    accum = plan.num_microbatches
    per_rank = global_batch // plan.dp
    micro = per_rank // accum
    generator = torch.Generator().manual_seed(1234 + mesh.dp_rank)

    def step() -> None:
        tokens = torch.randint(0, cfg_model.vocab_size, (per_rank, seq_len + 1), generator=generator).to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (per_rank, seq)
        if pipeline is not None:
            pipeline_step(pipeline, mesh, inputs, targets, autocast=autocast)
        else:
            for i in range(accum):
                set_gradient_sync(model, i == accum - 1)
                rows = slice(i * micro, (i + 1) * micro)
                with loss_context(plan):
                    loss = batch_loss(model, inputs[rows], targets[rows], autocast) / accum
                    (loss + moe_aux_loss.aux_loss(model) / accum).backward()
        clip_grad_norm(model.parameters(), 1.0, pp_group=mesh.group("pp"), experts=expert_params(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, optimizer


def ddp_bucket_bytes(model) -> int:
    """Bytes of a DDP reducer's gradient buckets, which the trackers never see: the reducer
    allocates each bucket's flat tensor in C++ when it is built (and again when it rebuilds
    the buckets after the first step) and keeps them all for its lifetime, as a second copy
    of the gradients unless `gradient_as_bucket_view=True`. DDP's own logging data lists
    their sizes. 0 for anything but DDP."""
    logging_data = getattr(model, "_get_ddp_logging_data", None)
    if logging_data is None:
        return 0
    sizes = str(logging_data().get("bucket_sizes", ""))
    return sum(int(size) for size in sizes.split(",") if size.strip())


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of what the optimizer keeps between steps (AdamW's two moments and step counts; a
    DTensor's local shard). The trackers label every tensor made inside `step()` as optimizer
    state, also the temporaries of torch's foreach AdamW (the square roots of the second moments
    and the update: one parameter-sized list at a time, freed when step returns); those are left
    to the total."""
    storages: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def measure_rank(model_name: str, plan_text: str, global_batch: int, seq_len: int, dtype: str, device_name: str,
                 steps: int = 1) -> dict:
    """On one rank of a started process group: each category's peak bytes and the total's peak
    over `steps` optimizer steps after a first, untracked one."""
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule
    from torch.utils.weak import WeakIdKeyDictionary

    from phalanx.model.by_name import model_config
    from phalanx.parallel.apply import parallelize
    from phalanx.plan_model_checks import validate_for_model
    from phalanx.parallel.mesh import build_mesh
    from phalanx.plan import plan_from_string
    from phalanx.local_device import pick_device

    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = model_config(model_name)
    plan = validate_for_model(plan_from_string(plan_text or f"dp={world}", world), cfg, global_batch=global_batch, seq_len=seq_len,
                              dtype=dtype)
    device = pick_device(device_name)
    mesh = build_mesh(plan, device)
    micro = global_batch // plan.dp // plan.num_microbatches
    model = parallelize(cfg, mesh, seed=0, seq_len=seq_len, microbatch_tokens=micro * seq_len)
    step, optimizer = _step_fn(model, mesh, plan, cfg, global_batch=global_batch, seq_len=seq_len, dtype=dtype,
                               device=device)
    # Outside the trackers: the pipeline's first step infers shapes with autograd.grad, which their
    # hooks refuse; after it the optimizer state exists, as in every later step. DDP rebuilds its
    # buckets in the second step's forward (in the order the first backward produced gradients):
    # tracked, that new allocation would read as an activation, so DDP takes two steps here, and
    # its buckets are added to the total below.
    for _ in range(2 if ddp_bucket_bytes(model) else 1):
        step()
    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(model, optimizer)
    else:
        tracker = MemTracker()
    tracker.track_external(model, optimizer)

    peaks = dict.fromkeys(CATEGORIES, 0)
    original = tracker._update_peak_stats

    def update_peaks(state) -> None:  # after every operation: each category's running maximum
        original(state)
        for snap in tracker._curr_mem_snap.values():
            now = dict.fromkeys(CATEGORIES, 0)
            for key, value in snap.items():
                name = _TRACKER_CATEGORY.get(getattr(key, "value", key))
                if name:
                    now[name] += value
            for name in CATEGORIES:
                peaks[name] = max(peaks[name], now[name])

    tracker._update_peak_stats = update_peaks
    roots = {id(model), *(id(chunk) for chunk in getattr(model, "chunks", ()))}

    class ForgetRootCalls(WeakIdKeyDictionary):
        # The trackers refuse a root module's second forward (the next micro-batch or step, or a
        # pipeline chunk's next micro-batch) as "multiple iterative calls"; a root reads as new
        # in forward, so only its per-module statistics, which this script does not read, start
        # over. Tracked storages stay.
        def __contains__(self, key) -> bool:
            if id(key) in roots and not tracker._mod_tracker.is_bw:
                return False
            return super().__contains__(key)

    tracker.memory_tracking = ForgetRootCalls()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    with tracker:
        for _ in range(steps):
            step()
    total = max((snap.get("Total", 0) for snap in tracker.get_tracker_snapshot("peak").values()), default=0)
    result = {**peaks, "optimizer_state": optimizer_state_bytes(optimizer), "total": total + ddp_bucket_bytes(model)}
    if device.type == "cuda":
        result["allocator_total"] = torch.cuda.max_memory_allocated(device)
    return result
