"""The fork server's process (``python -m synkhronos.backends.host.forkserver FD``): imports
what every worker imports, then forks a worker for each request of its master on the socket
``FD`` (the protocol and the master's side: ``forked.py``)."""
import ctypes
import os
import signal
import socket
import sys
import threading
import time

from .forked import libc, recv, send
from .procfs import parent_of, stat_fields

PRELOAD = ("numpy", "pytensor", "pytensor.link.numba.dispatch", "synkhronos.worker")
_PR_SET_PDEATHSIG = 1


def _threads():
    return len(os.listdir("/proc/self/task"))


def _retitle(argv):
    """Make /proc/self/cmdline read ``argv`` (written over this process's own command line,
    which was padded for it)."""
    fields = stat_fields()
    start, end = int(fields[45]), int(fields[46])          # arg_start, arg_end (fields 48, 49)
    data = b"\0".join(a.encode() for a in argv) + b"\0"
    if len(data) <= end - start:
        ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def _become_worker(req, fds, sock):
    """In the forked worker: the streams, environment and directory a spawned worker
    would have, then the worker's main loop (never returns)."""
    sock.close()
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    argv = [sys.executable, "-P", "-m", "synkhronos.worker", req["arg"]]
    _retitle(argv)
    import numpy as np
    np.random.seed()                  # (Python's random reseeds itself in a forked child)
    from synkhronos import worker
    sys.argv = [worker.__file__, req["arg"]]      # (as ``-m synkhronos.worker`` sets it)
    worker.exit_quickly(worker.main())


def _fork(req, fds, sock):
    """Fork a worker for ``req``; its pid once it is the master's child (or why not)."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:                                  # the middle process: forks, reports, exits
        pid = -1
        try:
            os.close(r)
            pid = os.fork()
        except BaseException:
            os._exit(1)
        if pid == 0:                                 # the worker
            os.close(w)
            _worker(req, fds, sock)
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        pid = int(fh.read() or -1)
    os.waitpid(middle, 0)
    for fd in fds:
        os.close(fd)
    if pid <= 0:
        return "fork failed"
    if parent_of(pid) not in (req["master"], None):    # (None: already gone and reaped)
        os.kill(pid, signal.SIGKILL)
        return "the master did not adopt the worker"
    return pid


def _worker(req, fds, sock):
    """The forked worker: once adopted, becomes the worker (never returns but by
    ``SystemExit``, which ends this interpreter normally)."""
    parent = os.getppid()
    end = time.monotonic() + 5.0
    while os.getppid() == parent and time.monotonic() < end:
        time.sleep(0.0002)                           # until the master adopts it
    try:
        _become_worker(req, fds, sock)
    except SystemExit:
        raise
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(1)


def serve(fd):
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the master's to handle
    libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    sock = socket.socket(fileno=fd)
    if os.getppid() == 1:
        return
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    if _threads() != 1 or threading.active_count() != 1:
        send(sock, f"{_threads()} threads after the imports: cannot fork safely")
        return
    send(sock, "ready")
    while True:
        req, fds = recv(sock, 3)
        if req is None:
            os._exit(0)                  # (the master closed its end: no teardown to wait for)
        try:
            send(sock, _fork(req, fds, sock) if len(fds) == 3 else "no descriptors")
        except OSError as e:
            send(sock, f"fork failed: {e}")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
