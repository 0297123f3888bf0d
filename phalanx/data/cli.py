"""The `prepare` subcommand. Registering it imports nothing heavy; running it never imports torch."""

from __future__ import annotations

import os
import sys

from phalanx.errors import UserError
from phalanx.process_count import check_process_count


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "prepare", help="tokenize text, folders, JSONL or parquet into a prepared directory for --data",
        description="Tokenize sources once into token shards that `phalanx train --data DIR` memory-maps "
                    "(format: docs/data.md).")
    p.add_argument("sources", nargs="+", metavar="SRC", help="text file, folder, .jsonl or .parquet (in this order)")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json, a folder holding one, or 'bytes'")
    p.add_argument("--out", required=True, help="the prepared directory to write (must not exist, or be empty)")
    p.add_argument("--field", default="text", help="JSONL field / parquet column holding the text (default: text)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of documents held out for validation, chosen by a hash of their position (default 0.01)")
    p.add_argument("--workers", type=int, default=0, help="encoding processes (default: one per CPU core)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run_prepare)


def run_prepare(args) -> int:
    # Imported when run, not at the top: it brings in numpy, which start-up need not wait for.
    from phalanx.data.prepare import prepare

    if args.workers < 0:
        raise UserError(f"--workers {args.workers} must not be negative (0: one per CPU core)")
    if args.workers:

        check_process_count(args.workers, "--workers")
    manifest = prepare(args.sources, tokenizer=args.tokenizer, out=args.out, field=args.field,
                       val_fraction=args.val_fraction, workers=args.workers, progress=args.progress)
    megabytes = sum(os.path.getsize(s) for s in manifest["sources"]) / 1e6
    print(f"prepared {args.out}: {manifest['documents']:,} documents, {manifest['tokens']:,} {manifest['dtype']} tokens "
          f"(train {manifest['train']['tokens']:,}, validation {manifest['val']['tokens']:,}) "
          f"from {megabytes:.1f} MB in {manifest['seconds']:.1f} s ({megabytes / manifest['seconds']:.1f} MB/s)",
          file=sys.stderr)
    return 0
