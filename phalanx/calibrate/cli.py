"""`phalanx calibrate`'s command line. Registering it imports nothing heavy; running it imports
torch (phalanx/calibrate/command.py)."""

from __future__ import annotations

from pathlib import Path

from phalanx.errors import UserError
from phalanx.output_path import check_output_file


def register(subparsers) -> None:
    """Add `calibrate` to an argparse subparsers object."""
    c = subparsers.add_parser("calibrate", help="measure this machine and write a cluster file")
    c.add_argument("--out", default=None, help="cluster file to write (default: the one --cluster local reads)")
    c.add_argument("--max-procs", type=int, default=4,
                   help="largest collective group size to measure (with --serve: the largest tp group probed)")
    c.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    c.add_argument("--quick", action="store_true", help="fewer sizes and repeats (for tests)")
    c.add_argument("--serve", action="store_true",
                   help="instead: time phalanx serve's engine steps, probe a real phalanx serve on 127.0.0.1 "
                        "(one process, then tp groups up to --max-procs), and fit the serving planner's "
                        "constants (serve-local.json beside the cluster file; docs/serve_planner.md)")
    c.add_argument("--model", default="small", help="with --serve: the model shape whose steps are timed")
    c.set_defaults(func=run_calibrate)


def run_calibrate(args) -> int:
    if args.serve:

        # Imported when run, not at the top: the command's own code, which start-up need not load.
        from phalanx.calibrate.serve_steps import calibrate_serve
        from phalanx.planner.serve.costs import serve_costs_path

        if args.max_procs < 1:
            raise UserError(f"--max-procs {args.max_procs}: with --serve, the largest tp group probed (1: none)")
        out = check_output_file(Path(args.out) if args.out else serve_costs_path(), "--out")
        calibrate_serve(args.model, out, max_procs=args.max_procs)
        return 0
    # Imported when run, not at the top: the command's own code, which start-up need not load.
    from phalanx.calibrate.command import calibrate_command

    return calibrate_command(args)
