"""Expert load of mixture-of-experts layers, counted once per step over the ranks.

* `end_step(model, mesh, cfg)`: take each MoE layer's load of the step (`MoE.take_load`, which
  returns the counts and restarts them), sum the per-expert token counts over the data-parallel
  ranks (one all-reduce for all layers), nudge the loss-free balancing biases with those
  global counts (so every rank applies the same update), and return the record fields:
  per MoE layer the tokens each expert and each dp rank received, and their imbalance
  (max - mean) / mean. "Received" counts token-expert assignments after any capacity drop;
  a rank receives what its experts computed (under expert parallelism, arrivals from its ep
  group; otherwise its own tokens' assignments).

Under pipeline parallelism each stage holds only its own layers; `end_step` sums the table over
the pp group too, so every rank, rank 0 (which writes metrics.jsonl) included, returns every
MoE layer of the model. The auxiliary losses live in `moe_aux_loss.py`, the heat-maps of a
finished run in `expert_load_plot.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from phalanx.model.init import canonical_name
from phalanx.model.config import ModelConfig
from phalanx.model.moe import MoE


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(layer index, MoE) for each MoE feed-forward this rank holds, in layer order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            found.append((canonical_name(name).split(".")[1], module))  # layers.<i>.feed_forward
    return found


def imbalance(load: torch.Tensor) -> float:
    """(max - mean) / mean: 0 when perfectly even, n - 1 when one of n takes everything."""
    mean = float(load.float().mean())
    return (float(load.max()) - mean) / mean if mean > 0 else 0.0


@torch.no_grad()
def end_step(model: nn.Module, mesh, cfg: ModelConfig) -> dict:
    """Take this step's counts from the layers (`MoE.take_load`), reduce them, update the
    balancing biases; every rank calls this.

    The table has one row per MoE layer of the whole model (from `cfg`), not only this rank's:
    a rank fills the rows of the layers it holds and leaves zeros elsewhere. Summing over "dp"
    adds the data-parallel ranks of a stage; summing over "pp" then fills in the other stages'
    rows (each layer lives on exactly one pp rank, so nothing is counted twice). Every rank
    issues the same two all-reduces of the same shape, whatever layers it holds, so stages
    with no MoE layer take part too. tp ranks hold the same layers and the same counts (their
    tokens are replicated), and are not reduced over; except that with ep_over_tp each of the
    dp x tp ranks receives its own rows, so the rank columns are one per dp x tp rank
    (dp_rank * tp + tp_rank) and summed over tp as well.
    """
    moe_ids = [layer for layer in range(cfg.n_layers) if cfg.is_moe_layer(layer)]
    if not moe_ids:
        return {}
    held = dict(moe_layers(model))  # layer index (str) -> MoE, this rank's layers only
    loads = {layer: moe.take_load() for layer, moe in held.items()}  # the step's counts; the layers restart theirs
    dp, dp_rank, n_experts = mesh.plan.dp, mesh.dp_rank, cfg.n_experts
    folded = mesh.plan.ep_over_tp and mesh.plan.ep > 1
    if folded:  # one rank column per dp x tp rank
        dp, dp_rank = dp * mesh.plan.tp, dp_rank * mesh.plan.tp + mesh.axis_rank("tp")
    packed = torch.zeros(len(moe_ids), n_experts + dp + 1, device=mesh.device)  # (layers, experts + dp + 1)
    for row, layer in zip(packed, moe_ids):
        load = loads.get(str(layer))
        if load is None:
            continue  # another stage's layer: its owner fills the row
        if load.tokens_per_expert is not None:
            row[:n_experts] = load.tokens_per_expert.float()
        row[n_experts + dp_rank] = float(load.received)
        row[-1] = float(load.dropped)
    if mesh.distributed and mesh.plan.dp > 1:
        dist.all_reduce(packed, group=mesh.group("dp"))
    if mesh.distributed and folded:
        ranks = packed[:, n_experts : n_experts + dp].contiguous()
        dist.all_reduce(ranks, group=mesh.group("tp"))
        packed[:, n_experts : n_experts + dp] = ranks
    if mesh.distributed and mesh.plan.pp > 1:
        dist.all_reduce(packed, group=mesh.group("pp"))
    record = {}
    for layer, row in zip(moe_ids, packed.cpu()):
        experts, ranks = row[:n_experts], row[n_experts : n_experts + dp]
        moe = held.get(str(layer))
        if moe is not None:
            moe.router.update_bias(experts.to(moe.router.expert_bias.device))
        record[str(layer)] = {
            "expert_tokens": [int(v) for v in experts], "rank_tokens": [int(v) for v in ranks],
            "expert_imbalance": imbalance(experts), "rank_imbalance": imbalance(ranks), "dropped": int(row[-1]),
        }
    return {"moe": record}
