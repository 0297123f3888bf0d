"""`phalanx` command line: train, prepare, export, generate, serve, plan, simulate, calibrate,
balance, match, blur, every one registered here. Subcommands import their heavy modules when
run, so `phalanx plan` (also `--serve`) and `balance` never load torch."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from phalanx.balance.cli import register as register_balance
from phalanx.calibrate.cli import register as register_calibrate
from phalanx.data.cli import register as register_prepare
from phalanx.errors import UserError
from phalanx.generate.cli import register as register_generate
from phalanx.hf.export_run import register as register_export
from phalanx.kernels.cli import register as register_kernels
from phalanx.planner.cli import register as register_plan
from phalanx.planner.serve.cli import serve_parser
from phalanx.planner.simulate import register as register_simulate
from phalanx.serve.cli import register as register_serve
from phalanx.threads import check_requested, set_wait_policy
from phalanx.train.config import load_config
from phalanx.train.restarts import earlier_user_error

# Flags of `phalanx train` that override TrainConfig fields (flag name -> field, type).
TRAIN_FLAGS: list[tuple[str, str, type, str]] = [
    ("--model", "model", str, "model preset (tiny, small, small-moe, llama3-8b, ...), or a Hugging Face model directory or config.json"),
    ("--init", "init", str, "auto (the model directory's weights when it has them) or random"),
    ("--data", "data", str, "prepared directory (phalanx prepare), text file, folder of text files, or .bin of uint16 tokens (default: Python's stdlib)"),
    ("--tokenizer", "tokenizer", str, "tokenizer.json (or a folder holding one) or bytes (default: the model directory's tokenizer.json, else bytes)"),
    ("--plan", "plan", str, "parallel layout, e.g. dp=2,zero=3 or dp=2,tp=2,pp=2,schedule=interleaved, or auto to let the planner choose (docs/layout.md; default: dp over all processes)"),
    ("--cluster", "cluster", str, "with --plan auto: the cluster to plan for, a preset (dgx-h100, ...) or a cluster file (default: this machine)"),
    ("--nproc", "nproc", int, "local worker processes (default: what the plan names, else one per GPU, else one per CPU core)"),
    ("--nnodes", "nnodes", str, "machines, N or MIN:MAX (elastic: goes on when nodes leave or join; --nproc is then per node, and --rdzv-endpoint is needed)"),
    ("--steps", "steps", int, "optimizer steps"),
    ("--global-batch", "global_batch", int, "sequences per optimizer step, whatever the layout"),
    ("--seq-len", "seq_len", int, "tokens per sequence"),
    ("--lr", "lr", float, "peak learning rate"),
    ("--seed", "seed", int, "seed for weights and data order"),
    ("--out", "out", str, "run directory (default: runs/<model>-<date>-<time>)"),
    ("--dtype", "dtype", str, "fp32 or bf16 (bf16 compute weights over fp32 masters)"),
    ("--device", "device", str, "auto, cpu or cuda"),
    ("--eval-every", "eval_every", int, "validation every N steps (0: never)"),
    ("--ckpt-every", "ckpt_every", int, "checkpoint every N steps (0: only at the end)"),
    ("--sample-tokens", "sample_tokens", int, "bytes of text to generate at the end"),
    ("--expert-slots", "expert_slots", int, "physical expert slots per MoE layer over the ep group: >= experts and a multiple of ep; extra slots replicate hot experts (default: one per expert)"),
    ("--rebalance-every", "rebalance_every", int, "move expert slots to the measured loads every K steps, weights and optimizer state with them (default 0: never)"),
    ("--replica-groups", "replica_groups", int, "split the --nproc processes into R data-parallel replica groups: a failed group restarts and rejoins from its peers while the others keep training (torchft: pip install 'phalanx[ft]'; docs/fault_tolerance.md)"),
    ("--lighthouse", "lighthouse", str, "with --replica-groups: HOST:PORT of a torchft lighthouse already running (default: phalanx starts one; required with --nnodes)"),
    ("--threads", "threads", int, "torch intra-op threads per worker (default 0: OMP_NUM_THREADS if set, else the cores this process may use divided among the local workers; docs/serve.md: Threads)"),
    ("--collective-timeout", "collective_timeout", float, "seconds a collective may wait for the other ranks before the worker fails, naming the operation and, where known, the missing rank (default 600)"),
]


def _add_train(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a model", description="Train a model on local or torchrun-launched workers.")
    parser.add_argument("--config", help="TOML file of settings (keys: the long flag names with _)")
    for flag, field, kind, text in TRAIN_FLAGS:
        parser.add_argument(flag, dest=field, type=kind, default=None, help=text)
    parser.add_argument("--resume", nargs="?", const="must", choices=("must", "auto"), default=None,
                        help="continue from the newest complete checkpoint in --out; 'auto': start fresh when there is none "
                             "(default with the flag alone: must)")
    parser.add_argument("--max-bad-steps", dest="max_bad_steps", type=int, default=None,
                        help="stop after this many steps in a row with a non-finite loss or gradient norm (default 5)")
    parser.add_argument("--sync-checkpoint", dest="sync_checkpoint", action="store_true", default=None,
                        help="save checkpoints in the loop (default: in the background while training goes on)")
    parser.add_argument("--max-restarts", dest="max_restarts", type=int, default=None,
                        help="restart the workers this many times after one fails, resuming from the newest checkpoint "
                             "(default 3 with several processes, 0 for one)")
    parser.add_argument("--compile", dest="compile", action="store_true", default=None,
                        help="torch.compile each transformer block (docs/layout.md: what it composes with and costs)")
    parser.add_argument("--float8", dest="float8", action="store_true", default=None,
                        help="torchao float8 training of the blocks' linear layers (pip install 'phalanx[float8]'; "
                             "faster only on GPUs with float8 matmuls)")
    parser.add_argument("--doc-mask", dest="doc_mask", action="store_true", default=None,
                        help="attention stays inside each document of a packed sequence (needs --data prepared by "
                             "phalanx prepare, which records where documents start)")
    parser.add_argument("--no-adapt", dest="adapt", action="store_false", default=None,
                        help="equal data-parallel shares (default: each rank's share of the global batch follows its "
                             "measured speed; docs/layout.md: Adapting to slow ranks)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    parser.add_argument("--no-plot", dest="plot", action="store_false", default=None,
                        help="no loss.png / experts.png at the end (metrics.jsonl and TensorBoard keep every figure)")
    parser.add_argument("--rdzv-endpoint", default="", help="host:port of the rendezvous (default: 127.0.0.1 and a free port)")
    parser.set_defaults(func=_run_train)


def _run_train(args) -> int:
    overrides = {field: getattr(args, field) for _, field, _, _ in TRAIN_FLAGS}
    overrides.update(resume=args.resume, progress=args.progress, plot=args.plot, adapt=args.adapt, max_bad_steps=args.max_bad_steps,
                     sync_checkpoint=args.sync_checkpoint, max_restarts=args.max_restarts,
                     compile=args.compile, float8=args.float8, doc_mask=args.doc_mask)
    cfg = load_config(args.config, overrides)
    if "RANK" in os.environ and cfg.out and (message := earlier_user_error(Path(cfg.out))):
        if os.environ["RANK"] != "0":
            return 2  # said once, by rank 0
        raise UserError(f"{message} (an earlier attempt stopped on this error; not retried)")
    # Imported when run, not at the top: it brings in numpy, torch, which start-up need not wait for.
    from phalanx.train.launch import launch_train

    return launch_train(cfg, rdzv_endpoint=args.rdzv_endpoint)


class Command(argparse.ArgumentParser):
    """A subcommand's parser. One whose `alternate` is set, (flag, parser builder), takes a
    second grammar: arguments holding that flag are that parser's (`plan --serve` and `simulate
    --serve`, the serving planner's own flags; argparse itself has no flag that switches a
    command's grammar)."""

    alternate: tuple[str, Callable[[], argparse.ArgumentParser]] | None = None

    def parse_known_args(self, args=None, namespace=None):
        if self.alternate and args is not None and self.alternate[0] in args:
            _, build = self.alternate
            return build().parse_known_args(args, namespace)
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand, registered here and only here (each module's `register` adds its own
    flags; none imports torch until its command runs)."""
    parser = argparse.ArgumentParser(prog="phalanx", description="Train transformers across many devices.")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=Command)
    _add_train(subparsers)
    register_export(subparsers)
    register_prepare(subparsers)
    register_generate(subparsers)
    register_serve(subparsers)
    register_plan(subparsers)
    register_simulate(subparsers)
    register_calibrate(subparsers)
    register_balance(subparsers)
    register_kernels(subparsers)  # match, blur
    for command in ("plan", "simulate"):  # --serve: the serving planner's grammar (planner/serve/cli.py)
        subparsers.choices[command].alternate = ("--serve", lambda command=command: serve_parser(command))
    return parser


def _parse(argv: list[str] | None):
    """The subcommand to run, as the parser above reads `argv` (`plan --serve` and `simulate
    --serve` included: their parsers' alternate grammar)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return lambda: _run_command(args)


def _run_command(args) -> int:
    """The parsed subcommand. Those that run models (their flags have --threads) get the passive
    OpenMP wait policy in the environment first, unless the user set one: the runtime reads it
    once, when torch is imported, which no command has done yet; every worker inherits it
    (phalanx/threads.py says why)."""
    if hasattr(args, "threads"):
        check_requested(args.threads)
        set_wait_policy(os.environ)
    return args.func(args)


def run(argv: list[str] | None = None) -> int:
    """Run the subcommand `argv` names (default: this process's arguments); return its exit
    status, every error already said in one line on stderr."""
    run_command = _parse(argv)
    try:
        return run_command()
    except UserError as error:
        print(f"phalanx: error: {error}", file=sys.stderr)
        return 2
    except MemoryError as error:  # an allocation the machine cannot make: say so, in one line
        print(f"phalanx: error: not enough memory ({error or 'an allocation failed'}); lower the sizes asked for",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("phalanx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `phalanx plan | head`: the reader has what it wanted
        # Python would report the pipe again while flushing stdout at exit; point it at nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def main(argv: list[str] | None = None) -> None:
    """The `phalanx` program: `run`, then exit with its status."""
    sys.exit(run(argv))
