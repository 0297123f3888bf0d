"""The progress bar of rank 0: step, loss, tokens/s and ETA (tqdm)."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, *, total: int, start: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", file=sys.stderr, dynamic_ncols=True,
                            disable=None)  # None: no bar when stderr is not a terminal

    def update(self, record: dict) -> None:
        if self.bar is None:
            return
        postfix = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
        if "val_loss" in record:
            postfix["val"] = f"{record['val_loss']:.3f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
