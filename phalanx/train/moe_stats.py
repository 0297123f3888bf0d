"""What the trainer does for mixture-of-experts layers, once per micro-batch and once per step.

* `aux_loss(model)`: the routers' configured balance and z losses, to add to the loss.
* `aux_losses_in_backward(model)`: under pipeline parallelism, where the schedule computes the
  loss, put those losses' gradients into the backward through each MoE layer's output instead.
* `end_step(model, mesh)`: sum the step's per-expert token counts over the data-parallel
  ranks (one all-reduce for all layers), nudge the loss-free balancing biases with those
  global counts (so every rank applies the same update), and return the record fields:
  per MoE layer the tokens each expert and each dp rank received, and their imbalance
  (max - mean) / mean. "Received" counts token-expert assignments after any capacity drop;
  a rank receives what its experts computed (under expert parallelism, arrivals from its ep
  group; otherwise its own tokens' assignments).
* `plot_expert_load(metrics, png)`: the run's load as heat-maps (layer x expert, layer x rank).

Under pipeline parallelism each stage holds only its own layers; `end_step` sums the table over
the pp group too, so every rank, rank 0 (which writes metrics.jsonl) included, returns every
MoE layer of the model.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from phalanx.model.init import canonical_name
from phalanx.model.config import ModelConfig
from phalanx.model.moe import MoE, in_recompute


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(layer index, MoE) for each MoE feed-forward this rank holds, in layer order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            found.append((canonical_name(name).split(".")[1], module))  # layers.<i>.feed_forward
    return found


def aux_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum of the auxiliary losses the MoE layers left from the last forward (0 if none)."""
    terms = [moe.aux_loss for _, moe in moe_layers(model) if moe.aux_loss is not None]
    return sum(terms) if terms else 0.0


class _AddAuxGradient(torch.autograd.Function):
    """Identity on a layer's output that, in backward, also seeds its auxiliary loss with
    gradient 1, as if that loss had been added to the loss being back-propagated.

    Under pipeline parallelism the schedule back-propagates the last stage's loss only; an
    auxiliary loss made on an earlier stage is in no graph that reaches it. Riding on the
    layer's output puts its gradient in the backward the stage runs anyway, at the point where
    that output's gradient arrives. (Megatron-Core's `MoEAuxLossAutoScaler` uses the same idea.)
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        # Shape, dtype and device only, not a saved tensor: activation checkpointing compares
        # the number of saved tensors with the recomputation, which skips this function.
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_like
        return grad, torch.ones(shape, dtype=dtype, device=device)


def _aux_into_backward(moe: MoE, args, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: attach the auxiliary loss the layer just made to its output."""
    if not moe.training or moe.aux_loss is None or in_recompute():
        return output  # recompute: the first forward already attached this micro-batch's loss
    aux, moe.aux_loss = moe.aux_loss, None  # consumed here: nobody else may add it again
    return _AddAuxGradient.apply(output, aux)


def aux_losses_in_backward(model: nn.Module) -> None:
    """Make each MoE layer's auxiliary losses part of the backward through its own output,
    for pipeline stages, where the trainer cannot add them to the loss it back-propagates.

    The gradient seeded is 1 per micro-batch's aux loss; the schedule then divides every
    gradient by the number of micro-batches (`scale_grads`), exactly as the non-pipelined
    loop back-propagates `(loss + aux) / microbatches` per micro-batch.
    """
    for _, moe in moe_layers(model):
        if moe.aux_loss_coef or moe.z_loss_coef:
            moe.register_forward_hook(_aux_into_backward)


def imbalance(load: torch.Tensor) -> float:
    """(max - mean) / mean: 0 when perfectly even, n - 1 when one of n takes everything."""
    mean = float(load.float().mean())
    return (float(load.max()) - mean) / mean if mean > 0 else 0.0


@torch.no_grad()
def end_step(model: nn.Module, mesh, cfg: ModelConfig) -> dict:
    """Reduce and reset this step's counters, update balancing biases; every rank calls this.

    The table has one row per MoE layer of the whole model (from `cfg`), not only this rank's:
    a rank fills the rows of the layers it holds and leaves zeros elsewhere. Summing over "dp"
    adds the data-parallel ranks of a stage; summing over "pp" then fills in the other stages'
    rows (each layer lives on exactly one pp rank, so nothing is counted twice). Every rank
    issues the same two all-reduces of the same shape, whatever layers it holds, so stages
    with no MoE layer take part too. tp ranks hold the same layers and the same counts (their
    tokens are replicated), and are not reduced over.
    """
    moe_ids = [layer for layer in range(cfg.n_layers) if cfg.is_moe_layer(layer)]
    if not moe_ids:
        return {}
    held = dict(moe_layers(model))  # layer index (str) -> MoE, this rank's layers only
    dp, dp_rank, n_experts = mesh.plan.dp, mesh.dp_rank, cfg.n_experts
    packed = torch.zeros(len(moe_ids), n_experts + dp + 1, device=mesh.device)  # (layers, experts + dp + 1)
    for row, layer in zip(packed, moe_ids):
        moe = held.get(str(layer))
        if moe is None:
            continue  # another stage's layer: its owner fills the row
        if moe.tokens_per_expert is not None:
            row[:n_experts] = moe.tokens_per_expert.float()
        row[n_experts + dp_rank] = float(getattr(moe.experts, "received_tokens", row[:n_experts].sum()))
        row[-1] = float(moe.dropped_tokens)
    if mesh.distributed and dp > 1:
        dist.all_reduce(packed, group=mesh.group("dp"))
    if mesh.distributed and mesh.plan.pp > 1:
        dist.all_reduce(packed, group=mesh.group("pp"))
    record = {}
    for layer, row in zip(moe_ids, packed.cpu()):
        experts, ranks = row[:n_experts], row[n_experts : n_experts + dp]
        moe = held.get(str(layer))
        if moe is not None:
            moe.router.update_bias(experts.to(moe.router.expert_bias.device))
            moe.tokens_per_expert, moe.dropped_tokens = None, 0
            if hasattr(moe.experts, "received_tokens"):
                moe.experts.received_tokens = 0
        record[str(layer)] = {
            "expert_tokens": [int(v) for v in experts], "rank_tokens": [int(v) for v in ranks],
            "expert_imbalance": imbalance(experts), "rank_imbalance": imbalance(ranks), "dropped": int(row[-1]),
        }
    return {"moe": record}


def plot_expert_load(metrics_path: Path, png_path: Path) -> bool:
    """Heat-maps of the whole run's tokens per (layer, expert) and per (layer, dp rank).

    Returns False (and writes nothing) when the run has no MoE records.
    """
    from phalanx.train.metrics import read_metrics

    records = [r["moe"] for r in read_metrics(metrics_path) if "moe" in r]
    if not records:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(records[0])
    experts = torch.tensor([[r[layer]["expert_tokens"] for layer in layers] for r in records]).sum(0)  # (layers, experts)
    ranks = torch.tensor([[r[layer]["rank_tokens"] for layer in layers] for r in records]).sum(0)  # (layers, dp)
    figure, axes = plt.subplots(1, 2, figsize=(11, 0.6 * len(layers) + 2.5), gridspec_kw={"width_ratios": [experts.shape[1], max(ranks.shape[1], 2)]})
    for ax, load, what in ((axes[0], experts, "expert"), (axes[1], ranks, "data-parallel rank")):
        share = load.float() / load.float().mean(dim=1, keepdim=True).clamp(min=1)  # 1.0 = mean load
        image = ax.imshow(share.numpy(), cmap="magma", aspect="auto")
        ax.set_xlabel(what)
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(layers)), layers)
        ax.set_xticks(range(load.shape[1]))
        ax.set_title(f"tokens per {what} / mean (max-mean)/mean: " + ", ".join(f"{imbalance(row):.2f}" for row in load))
        ax.title.set_fontsize(8)
        figure.colorbar(image, ax=ax)
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return True
