"""TensorBoard scalars beside metrics.jsonl, from the same step records, so that
`tensorboard --logdir runs/` shows every run under runs/ side by side.

metrics.jsonl stays the run's record; the event file is a view of it. Each step record becomes
the scalars of `scalars(record)`, tagged by what they measure:

    train/loss, train/val_loss, train/lr, train/grad_norm
    speed/tokens_per_s, speed/step_time_s
    ranks/compute_s/rank_R, ranks/wait_s/rank_R (each rank's compute and collective-wait seconds)
    memory/peak_mem_mb (rank 0), memory/peak_mem_mb_max_rank (the fullest rank)
    energy/energy_j (CUDA: all ranks' GPUs' joules for the step, NVML's counter)
    pipeline/bubble (measured), pipeline/bubble_formula (the schedule's)
    moe/expert_imbalance/layer_N, moe/rank_imbalance/layer_N, moe/dropped/layer_N

Rows without `loss` (event rows such as a restart) are not steps and give no scalars.

On resume the writer is opened with `purge_step` at the first step it will write: TensorBoard
then hides what the interrupted run's event file holds from that step on, so the steps redone
after the checkpoint show once, as they do in metrics.jsonl.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FLUSH_SECS = 10
"""The writer's background thread writes buffered events to disk this often, so a live
`tensorboard` sees a running job within seconds (and a killed one loses at most that much)."""

_TOP_LEVEL = {
    "loss": "train/loss", "val_loss": "train/val_loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "speed/tokens_per_s", "step_time_s": "speed/step_time_s",
    "peak_mem_mb": "memory/peak_mem_mb", "bubble": "pipeline/bubble", "bubble_formula": "pipeline/bubble_formula",
    "energy_j": "energy/energy_j",
}
"""metrics.jsonl key -> TensorBoard tag, for the keys that hold one number."""

_PER_MOE_LAYER = ("expert_imbalance", "rank_imbalance", "dropped")
"""Fields of a record's `moe[layer]` written as one scalar per layer."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """Tag -> value for one metrics.jsonl record; {} for a row that is not a step."""
    if "loss" not in record:
        return {}
    out = {tag: float(record[key]) for key, tag in _TOP_LEVEL.items() if record.get(key) is not None}
    if record.get("peak_mem_mb_by_rank"):
        out["memory/peak_mem_mb_max_rank"] = float(max(record["peak_mem_mb_by_rank"]))
    for key in ("compute_s", "wait_s"):
        for rank, value in enumerate(record.get(f"{key}_by_rank") or ()):
            out[f"ranks/{key}/rank_{rank}"] = float(value)
    for layer, stats in record.get("moe", {}).items():
        for field in _PER_MOE_LAYER:
            out[f"moe/{field}/layer_{layer}"] = float(stats[field])
    return out


class TensorBoardLog:
    """Rank 0's event file in `run_dir`; `write` takes the records MetricsLog writes."""

    def __init__(self, run_dir: Path, *, purge_step: int | None = None):
        # Imported here: tensorboard pulls in protobuf and more, which only a training run needs.
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge_step, flush_secs=FLUSH_SECS)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record["step"])

    def close(self) -> None:
        """Flush and close; safe to call twice."""
        self.writer.close()
