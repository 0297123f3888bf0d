"""A benchmark hook: timestamped marks of a replica group's failure and restart, one line each,
in the file `PHALANX_TEST_TIMELINE` names (nothing happens when it is not set).

`benchmarks/goodput.py --timeline` sets it for the replica arm, writes its own line at each
SIGKILL, and prints per kill the seconds from the kill to each mark: the group's watch finding
the dead sibling, its launcher starting the restart, the new workers starting, their process
group, model and torchft manager, the first quorum, the state received, the first committed
step, and the surviving group's steps meanwhile. Each line is `<unix time> <pid> <group>
<mark> [detail]`, appended with one write to a file opened for appending (lines of several
processes do not mix).
"""

from __future__ import annotations

import os
import time

TIMELINE_ENV = "PHALANX_TEST_TIMELINE"


def mark(what: str, detail: str = "") -> None:
    """Append one mark (a no-op unless TIMELINE_ENV is set)."""
    path = os.environ.get(TIMELINE_ENV)
    if not path:
        return
    line = f"{time.time():.4f} {os.getpid()} {os.environ.get('PHALANX_REPLICA_GROUP', '-')} {what} {detail}".rstrip()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
