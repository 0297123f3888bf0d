"""The dry run's commands, forked from one process that imported torch once.

On the GPU every part is its own interpreter (`device_check.run_command`), timed alone. The dry
run (`--dry-run`, what tests/test_device_check.py runs) only tests the scripts, and there a new
interpreter per command spent most of its CPU importing torch: about 3.5 s for each of the
seven parts and each `--help` and planner call between them, of a dry run's 70 s. Here a
forkserver (`multiprocessing`'s: a single-threaded process, so forking it is safe while the
runner's threads run) imports torch once, and each command runs in a child forked from it: the
script or module run as `python ...` would run it (`runpy`, `__main__`, its argv, its folder
first on sys.path), in its own session so that a timeout ends it and whatever it started, with
its output and its CPU time written to files the runner reads back.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import runpy
import signal
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ["torch"]
_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _child(argv: list[str], cwd: str, env: dict, out_path: str, err_path: str) -> None:
    """In the forked child: become `python *argv`, stdout to out_path and stderr to err_path
    (the same file when they are the same); exit with its code."""
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.dup2(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    if err_path == out_path:
        os.dup2(1, 2)
    else:
        os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.stdout = open(1, "w", buffering=1, errors="replace", closefd=False)
    sys.stderr = sys.stdout if err_path == out_path else open(2, "w", buffering=1, errors="replace", closefd=False)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, (int, type(None))):
            print(done.code, file=sys.stderr)
    except BaseException:  # what an interpreter would print, and its exit status
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    Path(out_path + ".cpu").write_text(str(sum(u.ru_utime + u.ru_stime for u in usage)))
    os._exit(code)


def run_forked(argv: list[str], cwd: Path, env: dict, timeout_s: float, *,
               stderr_apart: bool = False) -> tuple[int | None, str, str, float, float]:
    """(exit status or None when it timed out, stdout, stderr, wall seconds, CPU seconds) of
    `python *argv`, run in a child of the forkserver; stderr is in stdout unless `stderr_apart`."""
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        out_path, err_path = str(Path(tmp) / "stdout"), str(Path(tmp) / ("stderr" if stderr_apart else "stdout"))
        began = time.perf_counter()
        child = _context().Process(target=_child, args=(list(argv), str(cwd), dict(env), out_path, err_path))
        child.start()
        child.join(timeout_s)
        code: int | None = child.exitcode
        if child.is_alive():
            try:
                os.killpg(child.pid, signal.SIGKILL)  # its session: the command and what it started
            except ProcessLookupError:
                pass
            child.join()
            code = None
        seconds = time.perf_counter() - began
        read = lambda path: Path(path).read_text(errors="replace") if Path(path).exists() else ""  # noqa: E731
        cpu = read(out_path + ".cpu")
        return code, read(out_path), read(err_path) if stderr_apart else "", seconds, float(cpu) if cpu else 0.0
