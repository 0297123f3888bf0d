"""The run's record: one JSON line per step in metrics.jsonl, the same scalars as a TensorBoard
event file beside it, and a loss-curve PNG.

Every row has `step`. Step records carry `loss`, one per step; rows without it (event rows such
as `{"event": "skipped", "step": 5, "reason": "loss is nan"}` and `{"event": "restart", "step":
40, "restart": 1, "reason": "..."}`) are not steps, and every reader
here skips them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from phalanx.train.tensorboard_log import TensorBoardLog


class MetricsLog:
    """Appends step records, and writes them to TensorBoard too (phalanx/train/tensorboard_log.py);
    on resume, first drops records past the checkpoint's step (the resumed run writes them
    again) and a line a crash left half-written, so the file reads as one continuous run with
    one row per step. Call `close` at the end of the run (it flushes the event file)."""

    def __init__(self, path: Path, resume_step: int | None = None, *, shared: bool = False):
        """`shared`: the file is written by several writers in turn (replica groups, each of
        which may restart): the launcher prepared it (`prepare_metrics`); only append."""
        self.path = path
        if not shared:
            prepare_metrics(path, resume_step)
        # The first record written is resume_step + 1: TensorBoard hides older events from there on.
        self.tensorboard = TensorBoardLog(path.parent, purge_step=None if resume_step is None else resume_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        self.tensorboard.write(record)

    def close(self) -> None:
        self.tensorboard.close()


def prepare_metrics(path: Path, resume_step: int | None) -> None:
    """Empty the file for a fresh run; on resume, keep the rows up to `resume_step` (see MetricsLog)."""
    if resume_step is not None and path.exists():
        rows, broken = parse_lines(path.read_text())
        if broken:
            print(f"phalanx: warning: {path}: dropped {broken} unreadable line(s) (a write cut short by a crash)",
                  file=sys.stderr)
        kept = [row for row in rows if row["step"] <= resume_step]
        path.write_text("".join(json.dumps(row) + "\n" for row in kept))
    elif resume_step is None:
        path.write_text("")


def parse_lines(text: str) -> tuple[list[dict[str, Any]], int]:
    """The rows of a metrics.jsonl's text, and how many lines were not a JSON object with a
    step (a crash mid-write leaves a partial last line)."""
    rows, broken = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            broken += 1
    return rows, broken


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl, in order; event rows (no `loss`) and unreadable
    lines are skipped."""
    return [row for row in parse_lines(Path(path).read_text())[0] if "loss" in row]


def plot_loss(metrics_path: Path, png_path: Path) -> None:
    """Train loss per step, and validation loss where it was measured.

    A bare `Figure` with fixed margins, not pyplot with `tight_layout`: every run draws this,
    and dropping the layout pass took a plot of 4 steps from 0.22 to 0.16 s of CPU (2-core machine)."""
    # Imported when run, not at the top: it brings in matplotlib, which start-up need not wait for.
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    figure = Figure(figsize=(7, 4))
    figure.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.96)  # room for the axis labels
    axes = figure.add_subplot()
    axes.plot([r["step"] for r in records], [r["loss"] for r in records], label="train", linewidth=1)
    val = [r for r in records if "val_loss" in r]
    if val:
        axes.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per token)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(png_path, dpi=100)
