"""Rank 0's progress display: a tqdm bar (step, loss, tokens/s, ETA) on a terminal, and a
plain line every tenth of the run when stderr is a file or pipe (logs, CI)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, *, total: int, start: int, enabled: bool):
        self.total, self.start, self.enabled = total, start, enabled
        self.bar = None
        self.began = time.perf_counter()
        self.every = max(1, (total - start) // 10)
        if enabled and sys.stderr.isatty():
            # Imported when run, not at the top: it brings in tqdm, which start-up need not wait for.
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", file=sys.stderr, dynamic_ncols=True)

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            postfix = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
            if "val_loss" in record:
                postfix["val"] = f"{record['val_loss']:.3f}"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
            return
        step = record["step"]
        if (step - self.start) % self.every == 0 or step == self.total:
            elapsed = time.perf_counter() - self.began
            eta = elapsed / (step - self.start) * (self.total - step)
            val = f" val {record['val_loss']:.3f}" if "val_loss" in record else ""
            print(f"step {step}/{self.total} loss {record['loss']:.3f}{val} "
                  f"tok/s {record['tokens_per_s']:,.0f} eta {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
