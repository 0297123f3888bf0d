"""An expert-parallel MoE layer equals one process on each of its CPU compute paths.

On CPU, `ShardedExperts` picks by rows per local expert and per arrival block
(`phalanx/model/moe.py`): the grouped kernel on rows regrouped by expert, the per-expert loop
on regrouped rows, or the loop run block by block where the rows arrived (no regroup). Test
inputs this small would only ever take the first, so each case sets the two thresholds
(inside the forked ranks) to force one path, and checks, by spying, that it was the one taken.

ep=2 on 2 ranks, fp32. Each rank's output and input gradient must equal one process's layer
on the same tokens; the expert weights' gradients (each rank holds half the experts, fed by
both ranks' tokens) and the router's gradient summed over the ranks must equal one process's
on both ranks' tokens together. Only summation order differs (an expert's rows come in
another grouping, and its weight gradient adds them up in another order): ~1e-7 relative per
op in fp32 over sums of at most a few hundred products, so 1e-5 leaves margin; a row sent to
the wrong expert or a block given the wrong weights is off by O(1). Routing: random, and one
expert that no token chooses (its gate row pushed down), so a rank holds an idle expert and
receives empty blocks. The host reads exactly once per forward + backward on every path.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from phalanx.testing.fork_ranks import run_ranks

TOLERANCE = 1e-5
EP = 2
PATHS = {  # (CPU_LOOP_MIN_ROWS_PER_EXPERT, CPU_LOOP_MIN_ROWS_PER_BLOCK) that force each path
    "grouped_kernel": (10**9, 10**9),
    "regrouped_loop": (0, 10**9),
    "block_loop": (0, 0),
}


def _full_layer(idle_expert: bool):
    from phalanx.model.by_name import model_config
    from phalanx.model.moe import MoE

    torch.manual_seed(0)
    layer = MoE(model_config("tiny-moe"))
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.1)
        if idle_expert:
            layer.router.gate.weight[-1] = -layer.router.gate.weight[-1].sign() * 5.0  # never in a top-2
    return layer


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(4, 16, 64, generator=generator), torch.randn(4, 16, 64, generator=generator)


def _step(layer, x, upstream):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * upstream).sum().backward()
    return out.detach(), x.grad


def _compare_paths() -> dict:
    from phalanx.model import moe as moe_module
    from phalanx.parallel import expert as expert_module
    from phalanx.parallel.expert import shard_experts
    from phalanx.testing.host_syncs import count_host_reads

    rank = dist.get_rank()
    taken = {"kernel": 0, "regroup": 0}
    kernel, regroup = moe_module.grouped_mm_expert_ffn, expert_module.regroup_by_expert

    def spy_kernel(*args, **kwargs):
        taken["kernel"] += 1
        return kernel(*args, **kwargs)

    def spy_regroup(*args, **kwargs):
        taken["regroup"] += 1
        return regroup(*args, **kwargs)

    moe_module.grouped_mm_expert_ffn, expert_module.regroup_by_expert = spy_kernel, spy_regroup
    report = {}
    for idle_expert in (False, True):
        reference = _full_layer(idle_expert)
        inputs = [_tokens(r) for r in range(EP)]
        ref_out, ref_grad = _step(reference, torch.cat([x for x, _ in inputs]), torch.cat([u for _, u in inputs]))
        n_tokens, n_local = inputs[0][0].shape[0], reference.n_experts // EP
        mine = slice(rank * n_local, (rank + 1) * n_local)
        for path, (per_expert, per_block) in PATHS.items():
            moe_module.CPU_LOOP_MIN_ROWS_PER_EXPERT, moe_module.CPU_LOOP_MIN_ROWS_PER_BLOCK = per_expert, per_block
            layer = _full_layer(idle_expert)
            layer.experts = shard_experts(layer.experts, dist.group.WORLD, rank, EP)
            _step(layer, *inputs[rank])  # warm-up: the kernel's one-time check reads values
            layer.zero_grad()
            taken.update(kernel=0, regroup=0)
            with count_host_reads() as reads:
                out, grad = _step(layer, *inputs[rank])
            ours = slice(rank * n_tokens, (rank + 1) * n_tokens)
            torch.testing.assert_close(out, ref_out[ours], atol=TOLERANCE, rtol=TOLERANCE)
            torch.testing.assert_close(grad, ref_grad[ours], atol=TOLERANCE, rtol=TOLERANCE)
            for name in ("w1", "w2", "w3"):
                full = getattr(reference.experts, name).grad[mine]
                torch.testing.assert_close(getattr(layer.experts, name).grad, full, atol=TOLERANCE, rtol=TOLERANCE)
            router_grad = layer.router.gate.weight.grad.clone()
            dist.all_reduce(router_grad)
            torch.testing.assert_close(router_grad, reference.router.gate.weight.grad, atol=TOLERANCE, rtol=TOLERANCE)
            report[(path, idle_expert)] = {"taken": dict(taken), "reads": dict(reads)}
    return report


@pytest.fixture(scope="module")
def reports():
    return run_ranks(EP, _compare_paths, timeout_s=120)  # one launch for every case: forks are slow


@pytest.mark.parametrize("path", PATHS)
def test_each_cpu_path_equals_one_process(reports, path):
    from phalanx.model.moe import grouped_mm_works

    if path == "grouped_kernel" and not grouped_mm_works(torch.zeros(1, 64), torch.zeros(1, 64, 64)):
        pytest.skip("torch._grouped_mm does not run on this CPU build: the loop serves")
    for report in reports:
        for idle_expert in (False, True):
            case = report[(path, idle_expert)]
            # Each path did what it says: the kernel or not; a regroup (and its undo) or not.
            assert (case["taken"]["kernel"] > 0) == (path == "grouped_kernel"), case
            assert (case["taken"]["regroup"] > 0) == (path != "block_loop"), case
            assert case["reads"] == {"tolist": 1}, case
