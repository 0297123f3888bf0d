"""One MoE layer's step (forward + backward) on 4 gloo ranks, ep=4, with a skewed router:
one slot per expert against extra expert slots placed by the balancer from the measured load.

Reproduce, from the repository root:

    PYTHONPATH=. .venv/bin/python benchmarks/moe_rebalance.py [--tokens 2048 --slots 16 --repeats 15]

The layer is phalanx's `MoE` (8 SwiGLU experts, dim 256, hidden 512, softmax top-2) with a
frozen routing bias that makes experts 0 and 1 hot (about 48% and 27% of the assignments),
both held by ep rank 0 in today's layout. Three arms, built the way the trainer builds them
(`phalanx.parallel.expert.apply_ep` with `phalanx.train.expert_slot_training`):

  * one slot per expert: plain ep=4 (`shard_experts` without a placement; today's dispatch);
  * slots, even: S slots in the first placement the trainer uses before any load is known
    (`initial_placement`: the balancer's for even loads), routers with equal shares;
  * slots, rebalanced: the even arm's measured loads (tokens per expert summed over the ranks,
    rows each rank received) fed to `ExpertRebalancer.observe` as the trainer does at a
    rebalance step; its new placement, and `SlotRouter`s built from its load average.

With slots, the timed step includes `sum_replica_grads` (the replica gradient all-reduce that
replication adds to every optimizer step). All arms run in the same processes, on the same
weights and rows, repeats alternating (the starting arm rotates) so load from other work hits
them alike. Before timing, every arm's outputs, input gradients and expert gradients (each
replica's summed gradient against the unreplicated expert's) must agree with one slot per
expert: fp32, the same products summed in another grouping or order, so each within 1e-5 of
the tensor's largest element (`_assert_close`).

Printed per arm: the rows each rank's experts received in one step and busiest / mean,
the step's wall time (the slowest rank; fastest repeat and median) and tokens/s over the 4
ranks, and each rank's CPU time in the step (process time: the work a rank did, excluding
time it waited or was descheduled): the busiest rank's and the sum over ranks. Ratios are
tokens/s of an arm over one slot per expert, from each side's fastest repeat (on shared cores
noise only adds time), medians beside.

Why CPU time too: with 4 ranks on fewer cores, the step cannot be shorter than the total CPU
work / cores, however the rows are spread; the busiest rank bounds the step only when its own
work exceeds that. The CPU columns separate the two, and the last lines print, beside each
measured ratio, the ratio of those floors (what balance can give on this machine's cores) and
of the busiest ranks' CPU times (what it could give with a core per rank, as on one GPU per
rank). A waiting rank blocks in gloo without spinning (its CPU time follows its own rows), so
the CPU times measure work, not waiting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phalanx.testing.fork_ranks import run_ranks  # noqa: E402

EXPERTS, EP, TOP_K = 8, 4, 2
HOT_BIAS = (0.3, 0.2)
"""Routing bias of experts 0 and 1 (the others 0): added to the softmax scores before top-k,
as the trainer's frozen `expert_bias` is; the weights stay the unbiased scores."""
ARMS = ("one slot per expert", "slots, even", "slots, rebalanced")


def _full_layer(args):
    import torch

    from phalanx.model.config import ModelConfig
    from phalanx.model.moe import MoE

    cfg = ModelConfig(name="bench", dim=args.dim, n_heads=4, n_kv_heads=4, n_experts=EXPERTS,
                      experts_per_token=TOP_K, expert_ffn_dim=args.hidden)
    torch.manual_seed(0)
    layer = MoE(cfg)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, cfg.dim ** -0.5)
        bias = layer.router.expert_bias  # (experts,)
        bias.zero_()
        bias[: len(HOT_BIAS)] = torch.tensor(HOT_BIAS)
    return cfg, layer.state_dict()


def _layer(cfg, state, rank: int, placement=None, expert_load=None):
    """This rank's MoE layer: today's shard, or slots with their router (as apply_ep sets them)."""
    import torch.distributed as dist

    from phalanx.model.moe import MoE
    from phalanx.parallel.expert import shard_experts
    from phalanx.parallel.expert_slots import SlotRouter

    layer = MoE(cfg)
    layer.load_state_dict(state)
    layer.experts = shard_experts(layer.experts, dist.group.WORLD, rank, EP, placement=placement)
    if placement is not None:
        layer.experts.placement = placement
        layer.experts.router = SlotRouter(placement, rank, expert_load)
    return layer.train()


def _step(layer, x, upstream, replica_sum_s: list | None = None):
    """Forward + backward, and the replica gradient sum with slots: the trainer's per-step work.
    The sum's wall time is appended to `replica_sum_s` when given."""
    from phalanx.parallel.expert_slot_grads import sum_replica_grads

    x = x.detach().clone().requires_grad_()
    out = layer(x)
    (out * upstream).sum().backward()
    experts = layer.experts
    began = time.perf_counter()
    if experts.placement is not None:
        sum_replica_grads([experts.w1.grad, experts.w2.grad, experts.w3.grad], experts.placement)
    if replica_sum_s is not None:
        replica_sum_s.append(time.perf_counter() - began)
    return out.detach(), x.grad


def _loads(layer):
    """(tokens per expert summed over the ranks (E,), rows each rank's experts received (ep,)) of
    the steps since the last call; resets the layer's counters as `moe_stats.end_step` does."""
    import torch
    import torch.distributed as dist

    expert_tokens = layer.tokens_per_expert.clone()
    dist.all_reduce(expert_tokens)
    received = [torch.zeros(1, dtype=torch.long) for _ in range(EP)]
    dist.all_gather(received, torch.tensor([layer.experts.received_tokens]))
    layer.tokens_per_expert, layer.experts.received_tokens = None, 0
    return expert_tokens.tolist(), [int(r) for r in received]


def _assert_close(actual, expected, what: str) -> None:
    """Within fp32 rounding of sums taken in another grouping, relative to the tensor's scale.

    A weight gradient sums up to tokens x top-k rows' products; split over replicas (and added
    by an all-reduce) or computed by another kernel, its elements differ by a few ulps of the
    largest terms, so an element near zero can differ by a large relative amount: the bound is
    1e-5 of the tensor's largest element (fp32 eps is 6e-8; a missing or doubled row is of
    the order of the elements themselves).
    """
    error = float((actual - expected).abs().max())
    scale = float(expected.abs().max())
    if not error <= 1e-5 * scale:
        raise AssertionError(f"{what}: differs by {error:.3g}, over 1e-5 of its largest element {scale:.3g}")


def _check_same_math(layers, x, upstream) -> None:
    """Every arm's outputs, input gradients and expert gradients equal one slot per expert's."""
    import torch
    import torch.distributed as dist

    reference = None
    for name, layer in layers.items():
        out, x_grad = _step(layer, x, upstream)
        experts = layer.experts
        grads = [experts.w1.grad, experts.w2.grad, experts.w3.grad]
        if reference is None:
            whole = []
            for grad in grads:  # (E/ep, ...) per rank -> (E, ...): the unreplicated experts' gradients
                parts = [torch.empty_like(grad) for _ in range(EP)]
                dist.all_gather(parts, grad)
                whole.append(torch.cat(parts))
            reference = out, x_grad, whole
            continue
        held = list(experts.shard.expert_rows())  # the expert of each local slot
        _assert_close(out, reference[0], f"{name} output")
        _assert_close(x_grad, reference[1], f"{name} input gradient")
        for weight, grad, full in zip(("w1", "w2", "w3"), grads, reference[2]):
            _assert_close(grad, full[held], f"{name} {weight} gradient")
    for layer in layers.values():
        layer.zero_grad(set_to_none=True)
        _loads(layer)  # the check's counts are not the timed steps'


def _rank(args) -> dict:
    import torch
    import torch.distributed as dist

    from phalanx.parallel.expert_slots import SlotPlacement
    from phalanx.balance.rebalancer import ExpertRebalancer, initial_placement

    rank = dist.get_rank()
    cfg, state = _full_layer(args)
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.tokens, cfg.dim, generator=generator)  # (tokens, dim) this rank's rows
    upstream = torch.randn(args.tokens, cfg.dim, generator=generator)

    # The trainer's placements: the first (even loads), then a rebalance from measured loads.
    first = initial_placement(1, EXPERTS, args.slots, EP)  # (1 layer, S)
    even = _layer(cfg, state, rank, SlotPlacement.from_slots(first[0], EXPERTS, EP))
    _step(even, x, upstream)
    rebalancer = ExpertRebalancer(first, EXPERTS, EP, every=1, slot_bytes=0)
    expert_tokens, received = _loads(even)
    event = rebalancer.observe(1, [expert_tokens], [received])
    placed = SlotPlacement.from_slots(rebalancer.phy2log[0], EXPERTS, EP)
    layers = {ARMS[0]: _layer(cfg, state, rank),
              ARMS[1]: even,
              ARMS[2]: _layer(cfg, state, rank, placed, rebalancer.expert_load[0])}
    even.zero_grad(set_to_none=True)
    _check_same_math(layers, x, upstream)

    names = list(layers)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    replica_sum: dict[str, list[float]] = {name: [] for name in names}
    rows: dict[str, int] = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for turn in range(len(names)):
            name = names[(repeat + turn) % len(names)]
            layer = layers[name]
            dist.barrier()
            began, began_cpu = time.perf_counter(), time.process_time()
            _step(layer, x, upstream, replica_sum[name] if repeat else None)
            dist.barrier()
            if repeat:
                wall[name].append(time.perf_counter() - began)
                cpu[name].append(time.process_time() - began_cpu)
            layer.zero_grad(set_to_none=True)
            rows[name] = layer.experts.received_tokens
            layer.experts.received_tokens, layer.tokens_per_expert = 0, None
    return {"wall": wall, "cpu": cpu, "replica_sum": replica_sum, "rows": rows, "expert_tokens": expert_tokens,
            "event": event.row(), "placement": {ARMS[1]: first[0].tolist(), ARMS[2]: rebalancer.phy2log[0].tolist()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512, help="each expert's hidden size")
    parser.add_argument("--slots", type=int, default=2 * EXPERTS, help="expert slots S over the 4 ranks")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    per_rank = run_ranks(EP, _rank, args, timeout_s=1800)
    first = per_rank[0]
    load = first["expert_tokens"]
    print(f"MoE layer, {EXPERTS} experts (dim {args.dim}, hidden {args.hidden}), top-{TOP_K}, ep={EP} on 4 gloo ranks "
          f"(1 thread each), {args.tokens} tokens per rank, {args.repeats} timed repeats per arm")
    print("skewed router: share of assignments per expert " + " ".join(f"{t / sum(load):.3f}" for t in load))
    for name, slots in first["placement"].items():
        print(f"{name} placement (S={args.slots}, slot -> expert): {slots}")
    event = first["event"]
    print(f"rebalance event: imbalance (max - mean) / mean {event['imbalance_before']:.3f} measured before, "
          f"{event['imbalance_after']:.3f} predicted after; {event['moved_slots']} slots moved")
    fastest, median, floor, busiest_rank = {}, {}, {}, {}
    tokens = EP * args.tokens
    cores = len(os.sched_getaffinity(0))
    for name in ARMS:
        steps = [max(rank["wall"][name][i] for rank in per_rank) for i in range(args.repeats)]  # slowest rank
        busiest_cpu = [max(rank["cpu"][name][i] for rank in per_rank) for i in range(args.repeats)]
        total_cpu = [sum(rank["cpu"][name][i] for rank in per_rank) for i in range(args.repeats)]
        replica_sum = [max(rank["replica_sum"][name][i] for rank in per_rank) for i in range(args.repeats)]
        rows = [rank["rows"][name] for rank in per_rank]
        fastest[name], median[name] = min(steps), statistics.median(steps)
        busiest, total = statistics.median(busiest_cpu), statistics.median(total_cpu)
        floor[name], busiest_rank[name] = max(busiest, total / cores), busiest
        print(f"  {name}: rows per rank {rows}, busiest/mean {max(rows) / statistics.mean(rows):.2f}\n"
              f"    step fastest {1e3 * fastest[name]:6.1f} ms, median {1e3 * median[name]:6.1f} ms "
              f"(of which replica gradient sum {1e3 * statistics.median(replica_sum):5.1f} ms); "
              f"tokens/s fastest {tokens / fastest[name]:6.0f}, median {tokens / median[name]:6.0f}\n"
              f"    CPU per step (median): busiest rank {1e3 * busiest:6.1f} ms, sum over ranks {1e3 * total:6.1f} ms; "
              f"floor on {cores} cores max(busiest, sum / {cores}) = {1e3 * max(busiest, total / cores):6.1f} ms")
    base = ARMS[0]
    for name in ARMS[1:]:
        print(f"tokens/s {name} / {base} = {fastest[base] / fastest[name]:.3f} (fastest), "
              f"{median[base] / median[name]:.3f} (median); what the CPU times allow: "
              f"{floor[base] / floor[name]:.3f} on {cores} cores, {busiest_rank[base] / busiest_rank[name]:.3f} "
              f"with a core per rank (busiest rank's CPU)")


if __name__ == "__main__":
    main()
