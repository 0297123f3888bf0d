"""`--plot`: load per GPU before (one replica per expert, in order) and after the placement."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from phalanx.balance import measure


def plot_gpu_loads(load: np.ndarray, phy2log: np.ndarray, gpus: int, png: Path) -> None:
    """Left: each GPU's load in the layer that was most uneven before, before and after.
    Right: balancedness per layer, before and after."""
    # Imported when run, not at the top: it brings in matplotlib, which start-up need not wait for.
    import matplotlib

    matplotlib.use("Agg")
    # Imported when run, not at the top: it brings in matplotlib, which start-up need not wait for.
    import matplotlib.pyplot as plt

    before, after = measure.unreplicated_loads(load, gpus), measure.gpu_loads(load, phy2log, gpus)
    worst = int(measure.balancedness(before).argmin())
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    x = np.arange(gpus)
    left.bar(x - 0.2, before[worst], width=0.4, label="one replica per expert")
    left.bar(x + 0.2, after[worst], width=0.4, label="placed")
    left.axhline(before[worst].mean(), color="gray", linewidth=1, linestyle="--", label="mean")
    left.set_xlabel("GPU")
    left.set_ylabel("load")
    left.set_title(f"layer {worst} (the most uneven before)")
    left.legend(fontsize=8)
    layers = np.arange(len(load))
    right.plot(layers, measure.balancedness(before), "o-", label="one replica per expert")
    right.plot(layers, measure.balancedness(after), "o-", label="placed")
    right.xaxis.get_major_locator().set_params(integer=True)
    right.set_xlabel("layer")
    right.set_ylabel("balancedness (mean / max GPU load)")
    right.set_ylim(0, 1.05)
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)
