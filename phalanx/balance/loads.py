"""Reading per-layer expert loads: a JSON table, a .npy, or what `phalanx train` recorded.

A run directory (or its metrics.jsonl) holds one record per step; MoE models' records carry
`moe`: per MoE layer (keyed by layer index) `expert_tokens`, the tokens each expert computed
that step (docs/moe.md). The load is their sum over the steps, or over the last `window`
steps that have such records. Rows come in layer order; only MoE layers have one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from phalanx.errors import UserError


def read_load(path: str | Path, window: int | None = None) -> np.ndarray:
    """(layers, experts) loads from `path`; `window` applies to training records only."""
    path = Path(path)
    if window is not None and window < 1:
        raise UserError(f"--window={window} must be at least 1")
    if path.is_dir():
        path = path / "metrics.jsonl"
        if not path.exists():
            raise UserError(f"{path.parent} is not a run directory: it has no metrics.jsonl")
    if not path.exists():
        raise UserError(f"load file {path} does not exist")
    if path.suffix == ".jsonl":
        return _from_metrics(path, window)
    if window is not None:  # a table has no steps to window over: saying so beats ignoring it
        raise UserError(f"--window={window} sums the last steps of a run's records; {path} is a load table "
                        "(already summed): drop --window, or pass the run directory or its metrics.jsonl")
    if path.suffix == ".npy":
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as error:
            raise UserError(f"{path} is not a readable .npy array ({error})") from None
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise UserError(f"cannot read load file {path} ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise UserError(f"load file {path} is not text (a binary file?); expected a JSON [layers][experts] table, "
                        "a .npy or a run's metrics.jsonl") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not JSON ({error.msg} at line {error.lineno})") from None


def _from_metrics(path: Path, window: int | None) -> np.ndarray:
    records = []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read {path} as a run's records ({getattr(error, 'strerror', None) or 'not text'})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{number} is not a JSON record") from None
        if isinstance(record, dict) and record.get("moe"):
            records.append(record["moe"])
    if not records:
        raise UserError(f"{path} has no expert load records (`moe`): only runs of MoE models write them")
    if window is not None:
        records = records[-window:]
    layers = sorted(records[0], key=int)
    try:
        steps = [[r[layer]["expert_tokens"] for layer in layers] for r in records]
        return np.asarray(steps, dtype=float).sum(axis=0)  # (steps, layers, experts) -> (layers, experts)
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{path}: the `moe` records do not all hold expert_tokens for layers {', '.join(layers)}") from None
