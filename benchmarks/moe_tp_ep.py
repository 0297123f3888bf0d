"""One MoE layer's step (forward + backward) on 4 CPU ranks, dp=2 x tp=2 with ep=2: MoE
parallel folding (`ep_over_tp=true`) against today's layout, where every tp rank routes,
dispatches and computes all of its dp rank's rows (tp-fold duplicated expert work).

Both layouts run in the same processes, alternating repeat by repeat (the machine is shared
and noisy), on the same weights and tokens, built the way `phalanx.parallel.expert.apply_ep`
builds them (the same meshes, `shard_experts`, and for folding the tp group's `TpFold`):

  * duplicated: dp=2,tp=2,ep=2 - ep groups over dp, each rank holds 4 of 8 experts and
    computes all of its dp rank's 2 x tokens assignments;
  * folded:     dp=2,tp=2,ep=2,ep_over_tp=true - ep groups are the tp pairs, each rank holds
    4 of 8 experts and computes half of its dp rank's assignments;
  * folded ep=4: dp=2,tp=2,ep=4,ep_over_tp=true - one ep group of all 4 ranks, 2 experts each
    (an ep that dp=2 alone does not allow), reported beside.

Prints each layout's median step time (max over ranks) and duplicated / folded. Reproduce:

    PYTHONPATH=. python benchmarks/moe_tp_ep.py [--tokens 2048 --dim 256 --hidden 512 --repeats 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phalanx.testing.fork_ranks import run_ranks  # noqa: E402

LAYOUTS = {"duplicated": "dp=2,tp=2,ep=2", "folded": "dp=2,tp=2,ep=2,ep_over_tp=true",
           "folded_ep4": "dp=2,tp=2,ep=4,ep_over_tp=true"}


def _layer(plan_text: str, mesh_of, cfg, seed_state):
    """An MoE layer with this rank's experts for the plan, from the same full weights."""
    from phalanx.model.moe import MoE
    from phalanx.parallel.expert import shard_experts
    from phalanx.parallel.expert_fold import TpFold
    from phalanx.plan import plan_from_string

    plan = plan_from_string(plan_text, 4)
    mesh = mesh_of(plan)
    moe = MoE(cfg)
    moe.load_state_dict(seed_state)
    if plan.ep_over_tp:
        ep_mesh, fold = mesh.fold_dp_tp("edp", "ep", plan.ep), TpFold(mesh.group("tp"), mesh.axis_rank("tp"), plan.tp)
    else:
        ep_mesh, fold = mesh.split_dp("edp", "ep", plan.ep), None
    moe.experts = shard_experts(moe.experts, ep_mesh["ep"].get_group(), ep_mesh.get_local_rank("ep"), plan.ep,
                                fold=fold)
    return moe.train(), mesh


def _time(args) -> dict:
    import torch
    import torch.distributed as dist

    from phalanx.model.by_name import model_config
    from phalanx.parallel.mesh import build_mesh

    cfg = model_config("tiny-moe").replace(dim=args.dim, expert_ffn_dim=args.hidden, n_experts=8, experts_per_token=2)
    torch.manual_seed(0)
    from phalanx.model.moe import MoE

    full = MoE(cfg)
    with torch.no_grad():
        for param in full.parameters():
            param.normal_(0, cfg.dim ** -0.5)
    state = full.state_dict()
    layers = {name: _layer(text, lambda plan: build_mesh(plan, torch.device("cpu")), cfg, state)
              for name, text in LAYOUTS.items()}
    dp_rank = dist.get_rank() // 2  # tp innermost: ranks {0,1} are dp rank 0, {2,3} dp rank 1
    tokens = torch.randn(args.tokens, cfg.dim, generator=torch.Generator().manual_seed(1 + dp_rank))
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for repeat in range(args.repeats + 1):  # the first round warms up (grouped-mm check, buffers)
        for name, (moe, _) in layers.items():
            x = tokens.clone().requires_grad_()
            dist.barrier()
            start = time.perf_counter()
            moe(x).square().mean().backward()
            dist.barrier()
            if repeat:
                times[name].append(time.perf_counter() - start)
            moe.zero_grad(set_to_none=True)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per dp rank per step")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512, help="each expert's hidden size")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    per_rank = run_ranks(4, _time, args, timeout_s=1800)
    medians = {name: max(rank[name] for rank in per_rank) for name in LAYOUTS}
    print(json.dumps({
        "tokens_per_dp_rank": args.tokens, "dim": args.dim, "hidden": args.hidden, "experts": 8, "top_k": 2,
        **{f"{name}_ms": round(1e3 * value, 2) for name, value in medians.items()},
        "speedup_folded": round(medians["duplicated"] / medians["folded"], 2),
        "speedup_folded_ep4": round(medians["duplicated"] / medians["folded_ep4"], 2),
    }))


if __name__ == "__main__":
    main()
