"""`phalanx export RUN_DIR OUT_DIR [--step N]`: a training checkpoint as a Hugging Face directory.

The checkpoint's phalanx.json records the model's config and the run's settings; the DCP
shards, written by any layout, are read back into one process (DCP reshards on load) and
written by `phalanx.hf.writer` with the tokenizer files the run used (the copy in the run
directory; a byte-level run gets a tokenizer.json that maps byte i to id i).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from phalanx.checkpoint.reader import read_run_checkpoint
from phalanx.hf.byte_tokenizer import write_byte_tokenizer
from phalanx.hf.hf_export_config import export_family
from phalanx.model.config import ModelConfig
from phalanx.output_path import check_output_folder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def find_checkpoint(run_dir: Path, step: int | None) -> tuple[Path, dict]:
    """The intact checkpoint of `step` (default: the newest) and its phalanx.json, through the
    one checkpoint reader (phalanx.checkpoint.reader): files checked against the manifest."""

    found = read_run_checkpoint(run_dir, step)
    found.model_config()  # refused here when it records none
    return found.path, found.meta


def _tokenizer_files(run_dir: Path, scratch: Path) -> list[Path]:
    """The tokenizer the run used: the copy `phalanx train` keeps in the run directory, or for
    a byte-level run a tokenizer.json that maps byte i to id i."""
    found = [run_dir / name for name in TOKENIZER_FILES if (run_dir / name).is_file()]
    if found:
        return found

    return write_byte_tokenizer(scratch)


def load_checkpoint_model(path: Path, cfg: ModelConfig):
    """A one-process model holding the checkpoint's weights."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.checkpoint.store import load_model_weights
    from phalanx.model.init import build_model

    model = build_model(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.reset_buffers()
    load_model_weights(path, model, tied=cfg.tie_embeddings)
    return model.eval()


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.hf.writer import write_hf_directory

    run_dir = Path(run_dir)
    check_output_folder(out_dir, "OUT_DIR", empty=True)  # before any checkpoint is read
    found = read_run_checkpoint(run_dir, step)
    cfg = found.model_config()
    path = found.path

    export_family(cfg)  # refuse before reading any weights
    model = load_checkpoint_model(path, cfg)
    with tempfile.TemporaryDirectory() as scratch:
        files = _tokenizer_files(run_dir, Path(scratch))
        eos_id, eos_ids = _eos(files)
        return write_hf_directory(model.state_dict(), cfg, out_dir, tokenizer_files=files, eos_id=eos_id,
                                  generation_eos_ids=eos_ids)


def _eos(files: list[Path]) -> tuple[int | None, list[int]]:
    """The tokenizer's end-of-text id (config.json's), and every id that ends a sequence: it and
    the configured eos_token an instruct model's turns end with (generation_config.json's, which
    `transformers.generate`, vLLM and `phalanx serve` stop on)."""
    # Imported when run, not at the top: it brings in numpy, which start-up need not wait for.
    from phalanx.data.tokenizer import HFTokenizer

    tokenizer_json = next((f for f in files if f.name == "tokenizer.json"), None)
    if tokenizer_json is None:
        return None, []
    tokenizer = HFTokenizer(tokenizer_json)
    return tokenizer.eos_id, sorted(tokenizer.eos_ids)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="write a run's checkpoint as a Hugging Face model directory",
        description="Write a training checkpoint as a Hugging Face directory (config.json, sharded "
                    "safetensors, tokenizer files) that transformers.AutoModelForCausalLM loads.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by phalanx train")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="new folder to write")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    out = export_run(args.run_dir, args.out_dir, args.step)
    print(f"phalanx: wrote {out}")
    return 0
