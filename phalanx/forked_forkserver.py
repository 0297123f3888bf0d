"""multiprocessing's forkserver, forked from this process instead of started as a new interpreter.

A replica group's launcher starts, before its first attempt, the forkserver its restarts fork
their workers from (worker_group.warm_forkserver). multiprocessing starts a forkserver by
executing a new interpreter, which then imports the workers' code, torch included: some 2 s of
CPU alone and 5 s or more on two busy cores, once per replica group, all at the start of the run,
where it competed with the first attempt's workers (measured, 2 groups of 2 workers on 2 cores:
from the group launchers' start to the first step 4.2 to 11.3 s with the two imports, 2.3 s
without; the plain run's 1.5 to 6.3 s under the same loads).

The launcher has imported all of that already, and at that moment it is one thread (a group's
launcher is forked from the command's process just before): a fork of it is a process as clean
as the new interpreter (no lock held by another thread, which is why restarts fork from a
server at all) at the cost of a fork. That child runs multiprocessing's own server loop,
registered where multiprocessing looks for its forkserver, so the elastic agent's "forkserver"
start method uses it unchanged.

Only where it is safe and its internals are as known (CPython 3.11 and 3.12, one Python thread);
elsewhere `fork_forkserver` returns False and the caller starts the usual one.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

_forked: list[int] = []
"""The process id of the forkserver this process forked, if it did (`stop_forked_forkserver`)."""


def fork_forkserver(preload: str) -> bool:
    """Make multiprocessing's forkserver a fork of this process (which has imported `preload`);
    True when there is one now, False when it could not be done here (see above)."""
    # Imported when run, not at the top: multiprocessing's internals, needed only by a replica group's launcher.
    from multiprocessing import connection, forkserver, resource_tracker

    server = forkserver._forkserver
    known = all(hasattr(server, name) for name in ("_lock", "_forkserver_pid", "_forkserver_address",
                                                   "_forkserver_alive_fd"))
    if not known or sys.version_info >= (3, 13) or threading.active_count() > 1 or preload not in sys.modules:
        return False
    with server._lock:
        if server._forkserver_pid is not None:
            return True  # started already: by an earlier call, or a restart
        resource_tracker.ensure_running()  # as ensure_running does: the server's children share it
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        # Every client holds the write end of the "alive" pipe; the server ends when all closed it.
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server: multiprocessing's loop, then out without this process's atexit handlers
            status = 1
            try:
                os.close(alive_w)
                # As a new interpreter's: the launcher's own handlers are not the workers'.
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                forkserver.main(listener.fileno(), alive_r, [preload])
            except SystemExit:  # the loop's way to end, when no client is left
                status = 0
            finally:
                os._exit(status)
        os.close(alive_r)
        listener.close()
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
        _forked.append(pid)
    return True


def stop_forked_forkserver() -> None:
    """End the forkserver `fork_forkserver` started, before this process exits. Unlike a new
    interpreter, it holds copies of this process's open files, the run directory's lock among
    them, which it would otherwise keep a moment after this process is gone."""
    while _forked:
        pid = _forked.pop()
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
