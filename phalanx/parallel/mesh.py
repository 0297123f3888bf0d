"""One explicit object for the process layout: the plan, this rank's place, and the meshes.

Rank order: tp innermost (neighbouring ranks, the fastest links), then cp, then dp, then pp
outermost, so rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank. A one-process
run has no process group and no DeviceMesh: every accessor still answers (size 1, rank 0) so
training code has no special cases.

Context parallelism and the weights: cp ranks hold the same weights and different tokens, as
dp ranks do, so everything that places, reduces or shards weights (DDP, FSDP's zero levels,
expert parallelism, HSDP) sees one data-parallel axis "dp" of dp x cp ranks: `mesh.plan` is
the plan with dp x cp as its dp (`weights_view`), and with cp innermost of the two, that axis's
rank dp_rank * cp + cp_rank is exactly the rank order above. Only the data loader and the
attention layers tell the cp ranks apart (`batch_rank`, `cp_rank`, `cp_group`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from phalanx.plan import Plan, weights_view  # noqa: F401 (imported from here too)


@dataclass
class ParallelMesh:
    plan: Plan
    """The plan as the weights see it (`weights_view`: dp is dp x cp)."""
    device: torch.device
    world_size: int = 1
    rank: int = 0
    device_mesh: object | None = None
    """DeviceMesh with axes ("pp", "dp", "tp"), or None for a single process."""
    _split_meshes: dict = field(default_factory=dict)
    """split_dp's meshes, one per split (creating one makes process groups)."""
    cp: int = 1
    """Context-parallel degree: the adjacent ranks of the "dp" axis that share their sequences."""
    @property
    def distributed(self) -> bool:
        return self.device_mesh is not None

    def axis(self, name: str):
        """The sub-mesh of one axis ("pp", "dp" or "tp")."""
        assert self.device_mesh is not None, "single-process run has no mesh"
        return self.device_mesh[name]

    def axis_rank(self, name: str) -> int:
        return self.device_mesh.get_local_rank(name) if self.device_mesh is not None else 0

    def group(self, name: str):
        return self.axis(name).get_group() if self.device_mesh is not None else None

    @property
    def dp_rank(self) -> int:
        """Rank on the weights' data-parallel axis (dp x cp ranks)."""
        return self.axis_rank("dp")

    @property
    def batch_rank(self) -> int:
        """Which slice of the global batch this rank reads: its dp rank of the user's plan."""
        return self.dp_rank // self.cp

    @property
    def batch_ranks(self) -> int:
        """How many slices the global batch is cut into: the user's dp."""
        return self.plan.dp // self.cp

    @property
    def cp_rank(self) -> int:
        return self.dp_rank % self.cp

    def cp_group(self):
        """The process group of the cp ranks that share this rank's sequences (every rank
        must call this the first time: it creates process groups)."""
        return self.split_dp("batch", "cp", self.cp)["cp"].get_group() if self.distributed and self.cp > 1 else None

    def split_dp(self, outer: str, inner: str, inner_size: int):
        """A DeviceMesh ("pp", outer, inner, "tp") that splits the dp axis into
        dp / inner_size x inner_size, inner ranks adjacent; index it by name for sub-meshes.

        HSDP uses ("replicate", "shard"); expert parallelism ("edp", "ep"). Every rank must call
        this (it creates process groups); results are cached per split.
        """
        key = (outer, inner, inner_size)
        if key not in self._split_meshes:

            plan = self.plan
            ranks = torch.arange(self.world_size).view(plan.pp, plan.dp // inner_size, inner_size, plan.tp)
            self._split_meshes[key] = DeviceMesh(self.device.type, ranks, mesh_dim_names=("pp", outer, inner, "tp"))
        return self._split_meshes[key]

    def fold_dp_tp(self, outer: str, inner: str, inner_size: int):
        """A DeviceMesh ("pp", outer, inner) over each stage's dp x tp ranks taken as one axis
        (rank order dp_rank * tp + tp_rank) and split into groups of inner_size adjacent ranks:
        MoE parallel folding's ("edp", "ep"), whose ep group spans tp ranks first, then dp.
        Every rank must call this (it creates process groups); results are cached."""
        key = ("fold", outer, inner, inner_size)
        if key not in self._split_meshes:

            plan = self.plan
            ranks = torch.arange(self.world_size).view(plan.pp, plan.dp * plan.tp // inner_size, inner_size)
            self._split_meshes[key] = DeviceMesh(self.device.type, ranks, mesh_dim_names=("pp", outer, inner))
        return self._split_meshes[key]

    def _dp_split_root(self):
        """The DeviceMesh that FSDP's and TP's sub-meshes are cut from.

        FSDP2 on top of tensor-parallel DTensors concatenates the dp and tp sub-meshes, which
        only works when both come from the same root mesh. HSDP needs the dp axis split into
        ("replicate", "shard"); replicated data parallelism composed with tp or pp is run as
        HSDP with shard size 1 (FSDP2 then all-reduces gradients like DDP, but it understands
        DTensor parameters and pipeline stages, which DDP does not).
        """
        plan = self.plan
        if plan.shards_dp and plan.replicate == 1:
            return self.device_mesh
        shard = plan.dp // plan.replicate if plan.shards_dp else 1
        return self.split_dp("replicate", "shard", shard)

    def fsdp_mesh(self):
        """The mesh `fully_shard` takes: 1-D "dp", or 2-D ("replicate", "shard") for HSDP."""
        root = self._dp_split_root()
        return root["dp"] if root is self.device_mesh else root["replicate", "shard"]

    def tp_mesh(self):
        """The "tp" sub-mesh, cut from the same root as `fsdp_mesh` (see `_dp_split_root`)."""
        if self.plan.dp > 1:
            return self._dp_split_root()["tp"]
        return self.device_mesh["tp"]

    def all_reduce_mean(self, value: torch.Tensor, axis: str = "dp") -> torch.Tensor:
        """Mean of `value` over one mesh axis (no-op for one process)."""
        size = getattr(self.plan, axis)
        if self.device_mesh is None or size == 1:
            return value
        value = value.clone()
        dist.all_reduce(value, group=self.group(axis))
        return value / size


def build_mesh(plan: Plan, device: torch.device) -> ParallelMesh:
    """The mesh for `plan` over the default process group (validated against its size)."""
    if not dist.is_initialized():
        plan.validate(1)
        return ParallelMesh(plan=plan, device=device)
    world_size = dist.get_world_size()
    plan.validate(world_size)

    weights = weights_view(plan)
    device_mesh = init_device_mesh(device.type, (weights.pp, weights.dp, weights.tp), mesh_dim_names=("pp", "dp", "tp"))
    return ParallelMesh(plan=weights, device=device, world_size=world_size, rank=dist.get_rank(),
                        device_mesh=device_mesh, cp=plan.cp)
