"""Turn a single-device model on the meta device into this rank's part of the layout.

The order is fixed, and each step relies on the ones before it:
  1. pipeline split  - delete the layers this stage does not own (plain deletions);
  2. tensor parallel - swap the remaining parameters for DTensors sharded over "tp";
  3. expert parallel - keep only this rank's experts, route tokens by all-to-all over "ep";
  4. recompute       - activation checkpointing wraps whole (already parallel) blocks;
  5. FSDP            - shard what is left over "dp" (wraps DTensors, so it comes after TP);
  6. materialize     - allocate and fill weights from the seed, each rank only its shard;
  7. DDP             - replicated data parallelism wraps real weights, so it comes last.
"""

from __future__ import annotations

from torch import nn

from phalanx.errors import UserError
from phalanx.model.config import ModelConfig
from phalanx.model.init import build_model, init_weights
from phalanx.parallel.data_parallel import apply_ddp, apply_fsdp
from phalanx.parallel.expert import apply_ep
from phalanx.parallel.mesh import ParallelMesh


def parallelize(cfg: ModelConfig, mesh: ParallelMesh, *, seed: int) -> nn.Module:
    plan = mesh.plan
    unsupported = [f"{k}={getattr(plan, k)}" for k in ("tp", "pp") if getattr(plan, k) > 1]
    if unsupported:
        raise UserError(f"this build of phalanx runs data and expert parallelism only; {', '.join(unsupported)} is not available yet")
    model = build_model(cfg)
    apply_ep(model, mesh)
    if plan.dp > 1 and plan.fsdp:
        apply_fsdp(model, mesh)
    init_weights(model, cfg, seed, mesh.device)
    if plan.dp > 1 and not plan.fsdp:
        model = apply_ddp(model, mesh)
    return model
