"""Which training layouts the trainer's `--expert-slots` allows, as the planner asks it
(the search skips the others, memory_fit.py's hints never suggest them); the rule itself is
`layout_rules.expert_slots_layout_problem`, shared with the trainer."""

from __future__ import annotations

from phalanx import layout_rules as rules
from phalanx.model.config import ModelConfig
from phalanx.planner.layout import Layout
from phalanx.planner.options import Options


def slots_problem(model: ModelConfig, layout: Layout, options: Options) -> str:
    """Why the trainer would refuse `--expert-slots` (Options.expert_slots) in this layout, or ""."""
    if not options.expert_slots:
        return ""
    return rules.expert_slots_layout_problem(
        options.expert_slots, ep=layout.ep, over_tp=layout.ep_over_tp, tp=layout.tp, pp=layout.pp,
        fsdp=rules.runs_fsdp(layout.replicas, zero=layout.zero, tp=layout.tp, pp=layout.pp),
        edp=layout.replicas // layout.ep, expert_shape=(model.moe_ffn_dim, model.dim), offload=layout.offload)
