"""Which settings a resumed run may change. The checkpoint's phalanx.json records the model's
config and the run's settings; the weights only mean something for the same model, sequence
length, tokenizer and data, so a change there is refused naming old and new. The layout, the
global batch and the world size may change (DCP reshards; batches are a function of the step)
and are said in the log."""

from __future__ import annotations

import os

from phalanx.errors import UserError

FIXED = ("seq_len", "tokenizer", "data")
"""TrainConfig fields a resumed run must keep (the model is compared by its config)."""
MAY_CHANGE = ("global_batch", "plan", "world_size", "expert_slots", "rebalance_every")


def _same_path(old: str, new: str) -> bool:
    """'' and 'bytes' are names; anything else is a path, compared resolved."""
    def norm(text: str) -> str:
        return text if text in ("", "bytes") else os.path.abspath(text)
    return norm(old) == norm(new)


def check_resume(saved: dict, *, model: dict, settings: dict, where: str) -> list[str]:
    """Raise UserError for a setting that cannot change; return one line per allowed change.
    `saved`: the checkpoint's phalanx.json; `settings`: this run's TrainConfig fields plus
    world_size. A checkpoint of an older phalanx records less: what it lacks is not compared."""
    old_train = saved.get("train", {})
    if "model" in saved and saved["model"] != model:
        old_name = old_train.get("model", saved["model"].get("name"))
        changed = sorted(k for k in set(saved["model"]) | set(model) if saved["model"].get(k) != model.get(k))
        raise UserError(f"cannot resume {where}: it was trained with model={old_name!r}, this run asks for "
                        f"model={settings['model']!r} (differs in {', '.join(changed)}); use another --out")
    for name in FIXED:
        if name not in old_train:
            continue
        old, new = old_train[name], settings[name]
        if (old != new) if name == "seq_len" else not _same_path(old, new):
            raise UserError(f"cannot resume {where}: it was trained with {name}={old!r}, this run asks for "
                            f"{name}={new!r}; use the same {name} or another --out")
    notes = []
    for name in MAY_CHANGE:
        old = saved.get(name) if name == "world_size" else old_train.get(name)
        if old is not None and old != settings[name]:
            shown = lambda value: "the default (dp over all processes)" if name == "plan" and value == "" else repr(value)  # noqa: E731
            notes.append(f"phalanx: resuming with {name}={shown(settings[name])} (the checkpoint was written with {shown(old)})")
    return notes
