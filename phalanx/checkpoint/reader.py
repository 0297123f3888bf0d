"""The one reader of a run's checkpoints, for every verb that reads a run (`train --resume`,
`export`, `generate`): which checkpoint to use, checked against its manifest before anything
reads a byte of it.

- Without a step: the newest checkpoint whose files match their manifest; each damaged one
  passed over is named on stderr (when asked), and a run whose checkpoints are all damaged is
  said to have damaged checkpoints, not none.
- With `--step N`: that checkpoint, or a one-line refusal saying whether it is missing or
  damaged (and why), naming the intact steps there are.

Torch-free: the folders, phalanx.json and checksums only (checkpoint_manifest.py).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from phalanx.checkpoint.manifest import damage, read_meta
from phalanx.errors import UserError
from phalanx.model.config import ModelConfig

_STEP_NAME = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint whose files match its manifest."""
    step: int
    path: Path
    meta: dict
    """Its phalanx.json: the step, the model's config, the run's settings, the manifest."""
    def model_config(self):
        """The ModelConfig it records; a UserError when it records none, or one that is not valid."""
        recorded = self.meta.get("model")
        if not isinstance(recorded, dict):
            raise UserError(f"{self.path} does not record its model's config (written by an older phalanx); cannot read it")
        try:
            return ModelConfig.from_dict(recorded)
        except (TypeError, ValueError) as error:
            raise UserError(f"{self.path}/phalanx.json: the model's config is damaged ({error})") from None


@dataclass(frozen=True)
class RunCheckpoints:
    """Every finished checkpoint folder of a run: the intact ones newest first, the damaged
    ones with the reason (a folder whose phalanx.json cannot be read is damaged too)."""
    run_dir: Path
    intact: list[Checkpoint]
    damaged: list[tuple[Path, str]]

    @classmethod
    def scan(cls, run_dir: Path) -> "RunCheckpoints":
        intact, damaged = [], []
        folder = Path(run_dir) / "checkpoints"
        paths = sorted(folder.glob("step_*")) if folder.is_dir() else []
        for path in paths:
            if path.suffix == ".tmp" or not path.is_dir():
                continue  # an unfinished save, never read
            try:
                meta = read_meta(path)
            except ValueError as error:
                damaged.append((path, str(error)))
                continue
            problem = damage(path, meta)
            if problem is None:
                intact.append(Checkpoint(meta["step"], path, meta))
            else:
                damaged.append((path, problem))
        # By the step in phalanx.json: names sort wrongly past step 999,999.
        return cls(Path(run_dir), sorted(intact, key=lambda c: c.step, reverse=True), damaged)

    @property
    def newest(self) -> Checkpoint | None:
        return self.intact[0] if self.intact else None

    def report_passed_over(self) -> None:
        """Name on stderr each damaged checkpoint newer than the one used."""
        chosen = self.newest
        for path, why in self.damaged:
            if chosen is not None and _step_of(path) is not None and _step_of(path) < chosen.step:
                continue  # older than the one used: it would not have been read anyway
            instead = f"using {chosen.path.name} instead" if chosen else "no complete checkpoint is left"
            print(f"phalanx: warning: checkpoint {path} is damaged ({why}); {instead}", file=sys.stderr)

    def none_found(self) -> str:
        """Why there is nothing to read: no checkpoint, or only damaged ones (the newest's reason)."""
        where = self.run_dir / "checkpoints"
        if not self.damaged:
            return f"no checkpoint found under {where}"
        path, why = max(self.damaged, key=lambda item: _step_of(item[0]) or -1)
        more = f" (and {len(self.damaged) - 1} more)" if len(self.damaged) > 1 else ""
        return f"every checkpoint under {where} is damaged: {path.name}: {why}{more}"

    def at_step(self, step: int) -> Checkpoint:
        """The intact checkpoint of `step`, else a UserError saying it is damaged or missing."""
        for found in self.intact:
            if found.step == step:
                return found
        steps = ", ".join(str(c.step) for c in sorted(self.intact, key=lambda c: c.step))
        have = f"; it has steps {steps}" if steps else "; it has no intact checkpoint"
        for path, why in self.damaged:
            if _step_of(path) == step:
                raise UserError(f"--step {step}: checkpoint {path} is damaged ({why}){have}")
        if not self.intact and not self.damaged:
            raise UserError(f"{self.run_dir} holds no checkpoint: {self.none_found()}")
        raise UserError(f"{self.run_dir} has no checkpoint of step {step}{have}")


def _step_of(path: Path) -> int | None:
    match = _STEP_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def latest_checkpoint(run_dir: Path, *, report: bool = False) -> tuple[int, Path] | None:
    """The newest intact checkpoint (step, path) under run_dir, if any; with `report`, each
    damaged one passed over is named on stderr."""
    found = RunCheckpoints.scan(run_dir)
    if report:
        found.report_passed_over()
    return (found.newest.step, found.newest.path) if found.newest else None


def no_checkpoint_reason(run_dir: Path) -> str:
    """For `train --resume` without a checkpoint to resume from: none, or only damaged ones."""
    return RunCheckpoints.scan(run_dir).none_found()


def read_run_checkpoint(run_dir: str | Path, step: int | None = None) -> Checkpoint:
    """What `export` and `generate` read: the checkpoint of `step`, or the newest intact one
    (damaged newer ones named on stderr); a UserError when there is none to read."""
    run_dir = Path(run_dir)
    if step is not None and step < 0:
        raise UserError(f"--step {step} must not be negative (it names the checkpoint after that many steps)")
    if not run_dir.is_dir():
        raise UserError(f"run directory {str(run_dir)!r} does not exist")
    found = RunCheckpoints.scan(run_dir)
    if step is not None:
        return found.at_step(step)
    if found.newest is None:
        raise UserError(f"{run_dir} holds no checkpoint to read: {found.none_found()}")
    found.report_passed_over()
    return found.newest
