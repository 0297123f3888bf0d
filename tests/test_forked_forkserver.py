"""phalanx/forked_forkserver.py: multiprocessing's forkserver as a fork of a one-thread process.

Run in a fresh interpreter of its own: the forkserver is that process's global state, and the
fork is taken only while the process is one thread (pytest's may not be)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import multiprocessing, os, sys
from multiprocessing import forkserver
import phalanx.forked_forkserver as ff

def child_pid(queue):
    queue.put((os.getpid(), os.getppid(), 'json' in sys.modules))

if __name__ == '__main__':
    import json  # the preload: imported here, so the server has it without importing anything
    assert ff.fork_forkserver('json')
    server = forkserver._forkserver._forkserver_pid
    assert ff.fork_forkserver('json')  # once: a second call keeps the first server
    assert forkserver._forkserver._forkserver_pid == server
    context = multiprocessing.get_context('forkserver')
    queue = context.Queue()
    process = context.Process(target=child_pid, args=(queue,))
    process.start()
    pid, parent, preloaded = queue.get(timeout=60)
    process.join(60)
    assert process.exitcode == 0, process.exitcode
    assert parent == server and preloaded, (parent, server, preloaded)
    ff.stop_forked_forkserver()
    try:
        os.kill(server, 0)
        raise SystemExit('the forkserver outlived stop_forked_forkserver')
    except ProcessLookupError:
        pass
    print('ok', server)
"""


def test_a_forked_forkserver_forks_the_workers_and_ends_when_told(tmp_path):
    """The server is a child of this process (no new interpreter), the processes the
    'forkserver' start method starts are its children and have the preloaded module; a second
    call keeps it; `stop_forked_forkserver` ends it (it holds copies of this process's files)."""
    script = tmp_path / "forked.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok"), done.stdout


def test_not_forked_from_a_process_with_threads():
    """A process with a second thread is not forked (a lock another thread holds would be
    copied held): the caller starts multiprocessing's usual server instead."""
    code = ("import threading, json, phalanx.forked_forkserver as ff; e = threading.Event(); "
            "t = threading.Thread(target=e.wait); t.start(); r = ff.fork_forkserver('json'); e.set(); t.join(); "
            "print(r)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[1])
    assert done.stdout.strip() == "False", done.stderr
