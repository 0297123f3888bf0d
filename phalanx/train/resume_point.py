"""Where a run starts: the checkpoint it resumes from (if any), and the plan it runs with when
the world size changed since that checkpoint (world_change.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from phalanx.errors import UserError
from phalanx.train.checkpoint import latest_checkpoint
from phalanx.train.checkpoint_manifest import read_meta
from phalanx.train.resume_settings import check_resume
from phalanx.train.world_change import plan_for_world


def resume_point(cfg, run_dir: Path, model_cfg, world_size: int, rank: int):
    """(cfg with the plan for this world size, (step, path) to resume from or None for a fresh
    run). Refuses a missing checkpoint under resume='must' and settings that cannot change, and
    logs (on rank 0) the ones that did."""
    found = latest_checkpoint(run_dir, report=rank == 0) if cfg.resume else None
    if cfg.resume == "must" and found is None:
        from phalanx.train.checkpoint_reader import no_checkpoint_reason

        raise UserError(f"--resume: {no_checkpoint_reason(run_dir)} (--resume auto starts fresh when there is none)")
    saved = read_meta(found[1]) if found else {}
    cfg = plan_for_world(cfg, world_size, model_cfg, saved_world=saved.get("world_size"), elastic=cfg.elastic)
    if found:
        notes = check_resume(saved, model=model_cfg.to_dict(), where=str(run_dir),
                             settings={**dataclasses.asdict(cfg), "world_size": world_size})
        for line in notes if rank == 0 else ():
            print(line, file=sys.stderr)
    return cfg, found
