"""The `balance` subcommand. Registering it imports nothing heavy; running it imports numpy
(never torch)."""

from __future__ import annotations

import json
import sys

from phalanx.errors import UserError
from phalanx.output_path import check_output_file


def register(subparsers) -> None:
    """Add `balance` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "balance", help="replicate hot experts and place them so every GPU carries about the same load",
        description="Place replicas of each layer's experts on GPUs (docs/balance.md).")
    p.add_argument("--load", required=True, help="per-layer expert loads: JSON [layers][experts], .npy, or a run directory / metrics.jsonl of `phalanx train`")
    p.add_argument("--replicas", type=int, required=True, help="physical expert slots per layer, over all GPUs")
    p.add_argument("--groups", type=int, default=1, help="expert groups (a token's experts come from few groups; default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs, over all nodes")
    p.add_argument("--policy", default="auto", help="auto (default: hierarchical when the groups split evenly over the nodes), hierarchical or global")
    p.add_argument("--no-refine", dest="refine", action="store_false", help="the greedy construction only (the reference's result)")
    p.add_argument("--previous", help="a previous --json output: move as few slots as it can")
    p.add_argument("--window", type=int, default=None, help="with a run's records: sum only the last K steps")
    p.add_argument("--plot", help="PNG of the load per GPU before and after")
    p.add_argument("--json", action="store_true", help="print JSON (phy2log, log2phy, logcnt, balancedness, ...)")
    p.set_defaults(func=run_balance)


def run_balance(args) -> int:
    # Imported when run, not at the top: it brings in numpy, which start-up need not wait for.
    from phalanx.balance.loads import read_load
    from phalanx.balance.solve import check_load, rebalance

    if args.plot:

        if not args.plot.lower().endswith(".png"):
            raise UserError(f"--plot {args.plot}: name a .png file")
        check_output_file(args.plot, "--plot")  # before the work, not after it
    load = check_load(read_load(args.load, args.window))
    previous = None
    if args.previous:
        try:
            with open(args.previous) as file:
                previous = json.load(file)["phy2log"]
        except FileNotFoundError:
            raise UserError(f"--previous {args.previous} does not exist") from None
        except IsADirectoryError:
            raise UserError(f"--previous {args.previous} is a folder; it takes a `phalanx balance --json` output") from None
        except OSError as error:
            raise UserError(f"--previous {args.previous} cannot be read ({error.strerror or error})") from None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise UserError(f"--previous {args.previous} is not a `phalanx balance --json` output (no phy2log)") from None
    result = rebalance(load, args.replicas, args.groups, args.nodes, args.gpus, policy=args.policy,
                       refine=args.refine, previous=previous)
    record = result.report(load)
    if args.plot:
        # Imported when run, not at the top: it brings in numpy, which start-up need not wait for.
        from phalanx.balance.plot import plot_gpu_loads

        plot_gpu_loads(load, result.phy2log, args.gpus, args.plot)
    if args.json:
        json.dump(record, sys.stdout)
        print()
    else:
        print(_table(record, result))
    return 0


def _table(record: dict, result) -> str:
    p = result.problem
    lines = [
        f"policy {record['policy']}: {p.layers} layers, {p.experts} experts in {p.groups} groups -> {p.replicas} slots "
        f"on {p.gpus} GPUs over {p.nodes} nodes ({p.slots_per_gpu} per GPU)",
        "",
        f"{'layer':>5}  {'balancedness':>12}  {'imbalance':>9}  {'most replicas':>13}",
    ]
    counts = record["logcnt"]
    for layer, (b, i) in enumerate(zip(record["balancedness"]["per_layer"], record["imbalance"]["per_layer"])):
        lines.append(f"{layer:>5}  {b:>12.4f}  {i:>9.4f}  {max(counts[layer]):>13}")
    before = record["before"]
    lines += [
        "",
        f"overall balancedness {record['balancedness']['overall']:.4f} (one replica per expert: {before['balancedness']:.4f}), "
        f"imbalance {record['imbalance']['overall']:.4f} (one replica per expert: {before['imbalance']:.4f})",
    ]
    if "moved_slots" in record:
        lines.append(f"moved slots: {record['moved_slots']} of {p.layers * p.replicas}")
    lines.append(f"computed in {record['seconds']:.4f} s; --json prints the placement (phy2log, log2phy, logcnt)")
    return "\n".join(lines)
