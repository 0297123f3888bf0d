"""Heat-maps of a finished run's expert load, read back from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import torch

from phalanx.train.metrics import read_metrics
from phalanx.train.moe_stats import imbalance


def plot_expert_load(metrics_path: Path, png_path: Path) -> bool:
    """Heat-maps of the whole run's tokens per (layer, expert) and per (layer, dp rank).

    Returns False (and writes nothing) when the run has no MoE records.
    """
    records = [r["moe"] for r in read_metrics(metrics_path) if "moe" in r]
    if not records:
        return False
    # Imported when run, not at the top: it brings in matplotlib, which start-up need not wait for.
    import matplotlib

    matplotlib.use("Agg")
    # Imported when run, not at the top: it brings in matplotlib, which start-up need not wait for.
    import matplotlib.pyplot as plt

    # A run resumed on another dp size has rows of two widths: the rank panel shows the newest size's.
    dp = len(next(iter(records[-1].values()))["rank_tokens"])
    records = [r for r in records if len(next(iter(r.values()))["rank_tokens"]) == dp]
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
