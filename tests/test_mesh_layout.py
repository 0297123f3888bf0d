"""Where ranks and shards land: rank order (tp innermost, pp outermost) and HSDP placements.

The equivalence tests would pass with a wrong but consistent rank order or with HSDP silently
running as plain FSDP; these check the layout itself on 4 gloo ranks.
"""

from __future__ import annotations

import torch

from phalanx.testing.fork_ranks import run_ranks


def _layout(plans: list[str]) -> dict:
    import torch.distributed as dist

    from phalanx.model.by_name import model_config
    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.mesh import build_mesh
    from phalanx.plan import plan_from_string

    out = {}
    for text in plans:
        mesh = build_mesh(plan_from_string(text, dist.get_world_size()), torch.device("cpu"))
        model = parallelize(model_config("tiny"), mesh, seed=0)
        weight = dict(model.named_parameters())["layers.0.attention.wq.weight"] if mesh.plan.pp == 1 else None
        out[text] = {
            "groups": {axis: sorted(dist.get_process_group_ranks(mesh.group(axis))) for axis in ("pp", "dp", "tp")},
            "placements": [type(p).__name__ + (f"({p.dim})" if hasattr(p, "dim") else "") for p in weight.placements] if weight is not None else None,
            "mesh_dims": list(weight.device_mesh.mesh_dim_names) if weight is not None else None,
            "local_rows": weight.to_local().shape[0] if weight is not None else None,
        }
    return out


def test_rank_order_and_hsdp_placements():
    plans = ["dp=4,fsdp=true,replicate=2", "dp=2,tp=2", "dp=2,pp=2"]
    results = run_ranks(4, _layout, plans)
    for rank, result in enumerate(results):
        # tp innermost: a tp pair is two neighbouring ranks; dp next; pp outermost.
        assert result["dp=2,tp=2"]["groups"]["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert result["dp=2,tp=2"]["groups"]["dp"] == [rank % 2, rank % 2 + 2]
        assert result["dp=2,pp=2"]["groups"]["dp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert result["dp=2,pp=2"]["groups"]["pp"] == [rank % 2, rank % 2 + 2]
        # HSDP: replicated over 2 groups, sharded (dim 0) within each of 2 adjacent ranks.
        hsdp = result["dp=4,fsdp=true,replicate=2"]
        assert hsdp["mesh_dims"] == ["replicate", "shard"]
        assert hsdp["placements"] == ["Replicate", "Shard(0)"]
        assert hsdp["local_rows"] == 64 // 2
        # Replicated dp with tp runs as HSDP with shard size 1 over tp-sharded weights.
        replicated = result["dp=2,tp=2"]
        assert replicated["mesh_dims"] == ["replicate", "shard", "tp"]
        assert replicated["placements"][0] == "Replicate" and replicated["local_rows"] == 64 // 2
