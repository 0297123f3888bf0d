"""How many copies of each token expert-parallel dispatch sends: group-limited routing. Torch-free.

Without a limit, each of a token's k experts may sit on any ep rank, and the dispatch
all-to-all carries k copies of it (what `stage_time` charges: T k h bytes). DeepSeek-V3's
group-limited routing (`expert_groups`, `topk_groups`; n_group and topk_group in its config)
puts each group of experts on one node and lets a token choose only among its topk_groups
best groups, so it reaches at most topk_groups nodes: a node-aware dispatch (DeepEP's) sends
one copy per node over the network and fans it out to that node's ranks over NVLink. The
copies crossing nodes per token are then min(k, topk_groups), and the all-to-all's bytes
shrink by that share. Where the groups do not map onto the ep group's nodes (one node, or
a group count that is not a multiple of the nodes), nothing is saved.
"""

from __future__ import annotations

from phalanx.model.config import ModelConfig


def copies_per_token(model: ModelConfig, *, ep: int, local: int) -> float:
    """Copies of one token the dispatch sends, with `local` of the `ep` ranks per node."""
    k = model.experts_per_token
    nodes = ep // max(local, 1)
    groups, topk = model.expert_groups, model.topk_groups or model.expert_groups
    if nodes <= 1 or topk >= groups or groups % nodes:
        return float(k)
    return float(min(k, topk, nodes))  # the chosen groups lie on at most topk of the nodes


def copies_share(model: ModelConfig, *, ep: int, local: int) -> float:
    """copies_per_token / k: the share of the unlimited dispatch's bytes that is sent."""
    if not model.n_experts:
        return 1.0
    return copies_per_token(model, ep=ep, local=local) / model.experts_per_token
