"""`phalanx calibrate`'s command line. Registering it imports nothing heavy; running it imports
torch (phalanx/calibrate/command.py)."""

from __future__ import annotations


def register(subparsers) -> None:
    """Add `calibrate` to an argparse subparsers object."""
    c = subparsers.add_parser("calibrate", help="measure this machine and write a cluster file")
    c.add_argument("--out", default=None, help="cluster file to write (default: the one --cluster local reads)")
    c.add_argument("--max-procs", type=int, default=4, help="largest collective group size to measure")
    c.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    c.add_argument("--quick", action="store_true", help="fewer sizes and repeats (for tests)")
    c.set_defaults(func=run_calibrate)


def run_calibrate(args) -> int:
    from phalanx.calibrate.command import calibrate_command

    return calibrate_command(args)
