"""One bounded check of a CUDA device: the CUDA tests, training throughput and MFU, generation
and serving, the kernels, and the planner beside each measurement; everything written as one
JSON and one Markdown table. Run it through benchmarks/device_check.sh (docs/device_check.md).

Each part (device_check_parts.py) is a subprocess with its own timeout, in its own process
session so that a timeout ends its workers too; a part that fails or runs out of time is
recorded with the end of its output, and the next one runs. All parts together stay within
--budget-s (default 540 s: 9 minutes): a part gets at most what is left, and none starts with
under 10 s left. The JSON and Markdown are rewritten after every part, so a check stopped from
outside keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_check_parts import PARTS, ROOT, RUN_ORDER, Context, Part  # noqa: E402
from device_check_report import markdown  # noqa: E402

MIN_PART_S = 10.0
TAIL_LINES = 25
LOG_LOCK = threading.Lock()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/device_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="every part at tiny sizes on the CPU (tests the script; no CUDA needed)")
    parser.add_argument("--out", default="", help="folder for device_check.json, .md and .log "
                                                  "(default: device_check-<UTC time> here)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="all parts together, seconds (default 540)")
    parser.add_argument("--only", default="", help="comma-separated part names (default: all): "
                                                   + ", ".join(p.name for p in PARTS))
    parser.add_argument("--jobs", type=int, default=0,
                        help="parts run at once (default 1 on a GPU, where each part is timed alone; 2 for --dry-run)")
    parser.add_argument("--cluster", default="", help="the planner's --cluster for this device "
                                                      "(default: the preset of the GPU's kind; local for --dry-run)")
    args = parser.parse_args(argv)
    known = {p.name for p in PARTS}
    unknown = [name for name in filter(None, args.only.split(",")) if name not in known]
    if unknown:
        parser.error(f"unknown part {unknown[0]!r}; choose among {', '.join(sorted(known))}")
    if args.jobs < 0:
        parser.error(f"--jobs {args.jobs}: at least 1 (0: the default)")
    return args


def environment(dry_run: bool) -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "host_cpus": os.cpu_count(), "dry_run": dry_run}
    if not dry_run:
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    else:
        env["device"] = "cpu (dry run)"
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        env["commit"] = "unknown"  # a copy of the tree without git
    return env


def device_cluster(args, env: dict) -> str:
    if args.cluster:
        return args.cluster
    if args.dry_run:
        return "local"
    from phalanx.planner.hardware import GPU_PRESETS

    upper = env["device"].upper()  # not this_machine(): a calibration file would make it `local`
    if "PCIE" in upper and "H100" in upper:
        return "pcie-h100"
    return next((preset for key, preset in GPU_PRESETS if key in upper), "local")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_command(command: list[str], timeout_s: float, env: dict, *, dry_run: bool = False) -> tuple[int | None, str, float, float]:
    """(exit status or None when it timed out, its output, wall seconds, CPU seconds). A dry
    run forks the command from a process that imported torch once (device_check_forks.py)."""
    if dry_run:
        from device_check_forks import run_forked

        code, output, _, seconds, cpu_s = run_forked(command[1:], ROOT, env, timeout_s)
        return code, output, seconds, cpu_s
    began = time.perf_counter()
    cpu_before = _children_cpu_s()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", env=env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        code = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its session: the part and the workers it started
        output, _ = process.communicate()
        code = None
    return code, output, time.perf_counter() - began, _children_cpu_s() - cpu_before


def shown(command: list[str]) -> str:
    """The command as one types it (quoted where needed), with `python` for this interpreter."""
    return shlex.join("python" if word == sys.executable else word for word in command)


def run_part(part: Part, ctx: Context, env: dict, log, alone: bool) -> dict:
    """Run one part within what is left of the budget and record it; `alone`: no other part
    runs meanwhile, so the CPU time of this process's children is this part's."""
    record: dict = {"name": part.name, "section": part.section, "title": part.title}
    left = ctx.deadline - time.perf_counter()
    if left < MIN_PART_S:
        return {**record, "seconds": 0.0, "status": f"not run: the {ctx.budget_s:.0f} s budget was spent"}
    step = part.step(ctx)
    if step.skip:
        return {**record, "status": step.skip, "seconds": 0.0}
    timeout = min(step.timeout_s, left)
    record.update(command=shown(step.command), timeout_s=round(timeout))
    print(f"device_check: {part.name}: {record['command']}  (at most {timeout:.0f} s)", flush=True)
    code, output, seconds, cpu_s = run_command(step.command, timeout, env, dry_run=ctx.dry_run)
    with LOG_LOCK:
        log.write(f"\n===== {part.name} ({shown(step.command)}) =====\n{output}\n")
        log.flush()
    record["seconds"] = round(seconds, 1)
    if alone:
        record["cpu_s"] = round(cpu_s, 1)
    record["status"] = "timed out" if code is None else "ok" if code == 0 else f"failed (exit {code})"
    try:
        record["figures"] = part.read(output)
    except (ValueError, KeyError, IndexError) as error:  # a line that looked right and was not: say so, go on
        record["figures"], record["reader_error"] = {}, f"{type(error).__name__}: {error}"
    if record["status"] == "ok" and not record["figures"]:
        record["status"] = "ok, but no figures found in its output"
    if record["status"] != "ok":
        record["output_tail"] = output.strip().splitlines()[-TAIL_LINES:]
    if part.planner is not None:
        try:
            record["planner"] = part.planner(ctx)
        except Exception as error:  # the planner's failure is recorded; the measurement stands
            record["planner"] = {"error": f"{type(error).__name__}: {error}"}
    return record


def write(out: Path, result: dict) -> None:
    (out / "device_check.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "device_check.md").write_text(markdown(result))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(f"device_check: no CUDA device here (torch {torch.__version__} sees none); run it on a GPU node, "
              "or with --dry-run to test the script on the CPU", file=sys.stderr)
        return 2
    began = time.perf_counter()
    stamp = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out or f"device_check-{stamp:%Y%m%d-%H%M%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    env_vars = {**os.environ, "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    if args.dry_run:
        env_vars["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a machine with a GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # also for the forkserver the dry run's commands fork from
    result = {"environment": environment(args.dry_run), "started": stamp.isoformat(timespec="seconds"),
              "budget_s": args.budget_s, "parts": []}
    chosen = set(filter(None, args.only.split(","))) or {p.name for p in PARTS}
    by_name = {p.name: p for p in PARTS}
    print(f"device_check: {result['environment']['device']}; writing {out}/device_check.json, .md and .log", flush=True)
    jobs = args.jobs or (2 if args.dry_run else 1)
    names = [n for n in RUN_ORDER if n in chosen]
    with open(out / "device_check.log", "w") as log, ThreadPoolExecutor(jobs) as pool:
        ctx = Context(dry_run=args.dry_run, cluster=device_cluster(args, result["environment"]), workdir=out,
                      deadline=began + args.budget_s, budget_s=args.budget_s)
        result["environment"]["planner_cluster"] = ctx.cluster
        running = [pool.submit(run_part, by_name[name], ctx, env_vars, log, jobs == 1) for name in names]
        for done in as_completed(running):
            record = done.result()
            print(f"device_check: {record['name']}: {record['status']} ({record['seconds']:.0f} s)", flush=True)
            result["parts"].append(record)
            result["parts"].sort(key=lambda r: names.index(r["name"]))
            result["wall_s"] = round(time.perf_counter() - began, 1)
            write(out, result)
    result["wall_s"] = round(time.perf_counter() - began, 1)
    write(out, result)
    # The table last, on stdout too: where only the end of the output comes back, it does.
    print(f"device_check: done in {result['wall_s']:.0f} s; {out}/device_check.md:\n\n{markdown(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
