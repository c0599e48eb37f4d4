"""Helpers shared by the synkhronos tests: /dev/shm entries, worker processes, waiting."""
import os
import time

from synkhronos import shm

# Every session prefix made by a runtime in this (pytest) process, in order of creation.
# conftest.py records them by wrapping ``synkhronos.shm.new_prefix``.
PREFIXES = []


def shm_entries(prefix):
    """Our /dev/shm entries (segments and semaphores) whose name starts with ``prefix``."""
    return shm.leftovers(prefix)


def entries_of(prefixes):
    """/dev/shm entries belonging to any of the session ``prefixes``."""
    out = []
    for p in prefixes:
        out.extend(shm_entries(p))
    return sorted(set(out))


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stat(pid):
    """(state, ppid) of a process, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            s = fh.read()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    return rest[0], int(rest[1])


def pid_running(pid):
    """True while ``pid`` exists and is not a zombie (an exited, unreaped process)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def worker_children(ppid=None):
    """Live ``synkhronos.worker`` processes whose parent is ``ppid`` (default: this process)."""
    ppid = os.getpid() if ppid is None else ppid
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        st = _stat(pid)
        if st is None or st[1] != ppid or st[0] in ("Z", "X"):
            continue
        if "synkhronos.worker" in _cmdline(pid):
            found.append(pid)
    return found


def mapped_shm(pid, prefix):
    """Distinct /dev/shm files of session ``prefix`` that process ``pid`` has mapped."""
    base = prefix.lstrip("/")
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6 and f"/dev/shm/{base}" in parts[5]:
                    names.add(parts[5].strip())
    except OSError:
        pass
    return names


def wait_until(pred, timeout, interval=0.05):
    """Poll ``pred()`` until true or ``timeout`` seconds pass; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


def runtime():
    """The active synkhronos runtime object (internal), or None."""
    import synkhronos.runtime as r
    return r._runtime
