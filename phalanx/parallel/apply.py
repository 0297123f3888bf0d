"""Turn a single-device model on the meta device into this rank's part of the layout.

The order is fixed, and each step relies on the ones before it:
  1. pipeline split  - delete the layers this stage does not own (plain deletions), so every
                       later step only touches what this rank keeps;
  1b. float8         - `--float8`: swap the blocks' linears for torchao's Float8Linear while
                       they are plain modules, before any wrapper (parallel/float8.py);
  2. tensor parallel - swap the remaining parameters for DTensors sharded over "tp"
                       (`parallelize_module` needs the plain modules, before any wrapper);
  2b. context parallel - `cp` (or `--doc-mask`): a pre-hook on every attention layer hands it
                       the whole sequence's keys and values over "cp" and block attention
                       without a mask (parallel/context_parallel.py); after TP, whose sequence-parallel
                       gather must run first, and before recompute, whose recomputation then
                       gathers again in backward;
  3. expert parallel - keep only this rank's experts, route tokens by all-to-all over "ep";
  4. compute weights - in bf16 where FSDP does not cast (one process, DDP, tp or pp without
                       dp): hooks give each module bf16 copies of its fp32 masters during its
                       forward (`mixed_precision.py`); after ep, whose pre-forward hooks must
                       see the masters, and before recompute, so the copies serve the
                       recomputation too;
  5. recompute       - activation checkpointing wraps whole (already parallel) blocks;
  5b. compile        - `--compile`: torch.compile each block (parallel/compile.py): after TP,
                       the compute-weight hooks and recompute, so the graph holds their ops,
                       before FSDP, whose hooks then run around the compiled block instead of
                       being traced into it;
  6. FSDP            - shard what is left over "dp" at the plan's zero level, precision and
                       offload (wraps DTensors, so it comes after TP, and wraps the
                       checkpointed block, whose recompute then runs inside the unit's
                       backward, after its one all-gather: counted in
                       tests/test_planner_fsdp_gathers.py);
  7. materialize     - allocate and fill weights from the seed or a checkpoint, each rank
                       reading only its shard;
  8. DDP             - replicated data parallelism wraps real weights, so it comes last
                       (only for pure data parallelism: with tp or pp, FSDP2 replicates).
With pipeline parallelism steps 2-7 run once per chunk this rank holds.
"""

from __future__ import annotations

from torch import nn

from phalanx.model.config import ModelConfig
from phalanx.model.init import WeightSource, build_model
from phalanx.parallel.compile import apply_compile
from phalanx.parallel.context_parallel import apply_context_parallel
from phalanx.parallel.data_parallel import apply_ddp, apply_fsdp, uses_fsdp
from phalanx.parallel.expert import apply_ep
from phalanx.parallel.float8 import apply_float8
from phalanx.parallel.materialize import materialize
from phalanx.parallel.mesh import ParallelMesh
from phalanx.parallel.mixed_precision import apply_compute_weights, mixed_precision
from phalanx.parallel.pipeline import StageModules, keep_only, stages_of_rank
from phalanx.parallel.recompute import apply_recompute
from phalanx.parallel.stage_split import split_stages
from phalanx.parallel.tensor_parallel import apply_tp


def _parallelize_part(model: nn.Module, cfg: ModelConfig, mesh: ParallelMesh, seed: int,
                      weights: WeightSource | None, expert_slots: dict | None = None, *,
                      compile: bool = False, float8: bool = False, doc_mask: bool = False) -> nn.Module:
    """Steps 1b-7 for one model or pipeline chunk."""
    plan = mesh.plan
    apply_float8(model, float8)
    if plan.tp > 1:
        apply_tp(model, mesh.tp_mesh(), sp=plan.sp)
    apply_context_parallel(model, mesh, doc_mask=doc_mask)
    apply_ep(model, mesh, expert_slots)
    if mixed_precision(plan) and not uses_fsdp(plan):  # FSDP2 gathers the weights in bf16 itself
        apply_compute_weights(model, plan.param_dtype)
    apply_recompute(model, plan.recompute, plan.recompute_layers)
    apply_compile(model, compile)
    if uses_fsdp(plan):
        apply_fsdp(model, mesh, units_below_block=not compile)
    return materialize(model, cfg, seed, mesh.device, weights)


def parallelize(cfg: ModelConfig, mesh: ParallelMesh, *, seed: int, seq_len: int = 0,
                microbatch_tokens: int = 0, weights: WeightSource | None = None,
                expert_slots: dict | None = None, compile: bool = False, float8: bool = False,
                doc_mask: bool = False) -> nn.Module:
    """This rank's model: a Transformer, or with pp > 1 a `StageModules` of its chunks.

    `weights`: where initial weights come from (a checkpoint, `phalanx.hf.weights`); default:
    drawn from `seed`. `seq_len` and `microbatch_tokens` only inform the pipeline split's cost
    estimate. `expert_slots`: {layer: SlotPlacement} with `--expert-slots` (else one slot per expert).
    `compile`, `float8`, `doc_mask`: `--compile`, `--float8` and `--doc-mask` (steps 5b, 1b, 2b).
    """
    plan = mesh.plan
    if plan.pp == 1:
        model = _parallelize_part(build_model(cfg), cfg, mesh, seed, weights, expert_slots, compile=compile, float8=float8,
                                  doc_mask=doc_mask)
        if plan.dp > 1 and not uses_fsdp(plan):
            model = apply_ddp(model, mesh)
        return model
    seq_len = seq_len or cfg.max_seq_len
    split = split_stages(
        cfg, plan.pp * plan.virtual, split=plan.split, seq_len=seq_len, tokens_per_microbatch=microbatch_tokens or seq_len
    )
    chunks, stages = [], stages_of_rank(plan, mesh.axis_rank("pp"))
    for stage in stages:
        chunk = keep_only(build_model(cfg), split[stage])
        chunks.append(_parallelize_part(chunk, cfg, mesh, seed, weights, expert_slots, compile=compile, float8=float8,
                                        doc_mask=doc_mask))
    return StageModules(chunks, stages)
