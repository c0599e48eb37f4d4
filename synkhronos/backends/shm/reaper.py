"""Removing what earlier sessions of this user left in /dev/shm when all their processes
were killed at once (nobody was left to clean up)."""
import os
import re

import posix_ipc

from . import segments as shm
from .control import BASE, MASTER_PID

_SESSION_CTRL = re.compile(r"synk_[0-9a-f]{16}_ctrl")


def _owner(name):
    try:
        return os.stat(os.path.join(shm.SHM_DIR, name + "_ctrl")).st_uid
    except OSError:
        return -1


def reap_stale_sessions():
    """Remove the segments of earlier sessions of this user whose master process is gone.

    A session cleans up after itself on close, on a master's SIGTERM and when its master
    dies; only when every process of a session was killed at once is there nobody left to
    do it.  Returns the number of sessions removed."""
    prefixes = {e[:-len("_ctrl")] for e in shm.leftovers("synk_") if _SESSION_CTRL.fullmatch(e)}
    reaped = 0
    for p in prefixes:
        try:
            seg = shm.Segment("/" + p + "_ctrl")
            pid = int(seg.array("int64", (BASE,))[MASTER_PID])
        except (OSError, ValueError, posix_ipc.Error):
            continue
        if pid <= 0 or _owner(p) != os.getuid():
            continue
        try:
            os.kill(pid, 0)
            continue                  # its master is alive (or the pid was reused): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shm.remove_all("/" + p)
        reaped += 1
    return reaped
