"""A fork server for worker processes: one process per master that has imported what every
worker imports (numpy, PyTensor, numba, synkhronos) and forks a worker on request.

A worker started with ``python -m synkhronos.worker`` spends ~1.2 CPU-seconds importing
before it can serve; forked from this process it starts in milliseconds and shares those
pages with its siblings.  Nothing changes for the master or the worker:

* the worker is the master's child, as a spawned one is: the server forks twice and the
  middle process exits, so the worker is re-parented to the master, which is made a child
  subreaper (``PR_SET_CHILD_SUBREAPER``) while it starts workers.  The master reaps it and
  reads its exit status; the worker's ``getppid()`` is the master;
* it gets the environment, working directory and standard streams (passed as file
  descriptors) a spawned worker would get, and its command line reads as one
  (``python -P -m synkhronos.worker {"rank": r}``);
* the server is single-threaded when it forks (checked: otherwise it refuses), never
  imports JAX or touches a GPU (those start in the worker, after the fork), and serves only
  workers whose environment equals its own but for ``NOT_AT_IMPORT`` variables.  It exits when
  its master's end of the socket closes (the master exited) or with its master (parent death
  signal).

``SYNK_FORK_SERVER=0`` turns it off (workers are spawned); when it cannot start, workers are
spawned as before."""
import atexit
import ctypes
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

PER_WORKER = ("SYNK_WORKER_CONFIG", "CUDA_VISIBLE_DEVICES")   # may differ between one server's workers
# variables that change while a program runs and that nothing reads at import (a worker
# still gets its own values: only which server forks it ignores them)
NOT_AT_IMPORT = PER_WORKER + ("PYTEST_CURRENT_TEST", "PWD", "OLDPWD", "_")
SERVER = "synkhronos.backends.host.forkserver"   # the server process's module
PAD = 160                     # room in the server's command line for a worker's
START_TIMEOUT = 120.0         # seconds for the server's imports
FORK_TIMEOUT = 5.0            # seconds for one fork (milliseconds; a stopped server costs this once)
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
_HEADER = struct.Struct("!I")


def enabled():
    return sys.platform.startswith("linux") and os.environ.get("SYNK_FORK_SERVER", "1") != "0"


def libc():
    return ctypes.CDLL(None, use_errno=True)


def send(sock, obj, fds=()):
    data = json.dumps(obj).encode()
    socket.send_fds(sock, [_HEADER.pack(len(data)) + data], list(fds))


def recv(sock, maxfds=0):
    """One message (and the descriptors sent with it); None at the end of the stream."""
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, maxfds)
    if not msg:
        return None, fds
    (size,) = _HEADER.unpack(msg[:_HEADER.size])
    data = msg[_HEADER.size:]
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return None, fds
        data += more
    return json.loads(data), fds


# ------------------------------------------------------------------------------------------
# The master's side


class ForkedWorker:
    """A worker forked by the server and adopted by this process: the part of
    ``subprocess.Popen`` the launcher uses (``pid``, ``poll``, ``wait``, ``kill``)."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None
        self.status_known = True     # False: reaped by someone else (``os.wait()`` in user code)

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:        # reaped elsewhere: gone, its status unknown
                self.returncode, self.status_known = 0, False
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ForkServer:
    """The running server of this process, for one environment (``for_env``)."""

    _current = None
    _failed = None

    def __init__(self, env):
        self.env, self.owner = env, os.getpid()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [sys.executable, "-P", "-m", SERVER, str(theirs.fileno()), "-" * PAD]
        try:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         pass_fds=[theirs.fileno()], close_fds=True, process_group=0)
        finally:
            theirs.close()
        self.sock = mine
        try:
            self.sock.settimeout(START_TIMEOUT)
            ready, _ = recv(self.sock)
            if ready != "ready":
                raise RuntimeError(f"the fork server did not start: {ready!r}")
            self.sock.settimeout(FORK_TIMEOUT)
        except BaseException:
            self.close(kill=True)
            raise

    @classmethod
    def for_env(cls, env):
        """The server for workers of environment ``env``, started if needed; None when it
        is off or cannot start (then workers are spawned)."""
        if not enabled():
            return None
        key = {k: v for k, v in env.items() if k not in NOT_AT_IMPORT}
        cur = cls._current
        if cur is not None and cur.owner != os.getpid():     # (inherited through os.fork: not ours)
            cur.close()
            cls._failed = cur = None
        if cur is not None and cur.env == key and cur.proc.poll() is None:
            return cur
        if cur is not None:
            cur.close()
        if key == cls._failed:
            return None                  # (it failed to start in this environment: not again)
        try:
            cls._current = cls(key)
        except (OSError, RuntimeError, ValueError):
            cls._failed = key
            return None
        atexit.register(cls._current.close)      # (no "still running" at exit; a no-op once closed)
        return cls._current

    def fork(self, arg, env):
        """A worker (``ForkedWorker``) with command-line argument ``arg`` and environment
        ``env``, or None when the server cannot fork it."""
        with open(os.devnull, "rb") as null:
            try:
                send(self.sock, {"arg": arg, "env": env, "cwd": os.getcwd(), "master": os.getpid()},
                     [null.fileno(), 1, 2])
                reply, _ = recv(self.sock)
            except (OSError, ValueError):
                reply = None
        if not isinstance(reply, int):
            self.close(kill=True)
            return None
        return ForkedWorker(reply)

    def close(self, kill=False):
        if ForkServer._current is self:
            ForkServer._current = None
        atexit.unregister(self.close)
        try:
            self.sock.close()
        except OSError:
            pass
        if self.owner != os.getpid():         # (a copy inherited through os.fork: not our child)
            return
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout=2.0)      # (it exits at once when its socket closes)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Adopting:
    """``with Adopting():`` this process adopts the orphaned processes below it (the forked
    workers) while it starts workers; the setting is restored after."""

    def __enter__(self):
        c = libc()
        was = ctypes.c_int(0)
        c.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
        self.was = was.value
        self.ok = c.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        return self

    def __exit__(self, *exc):
        if self.ok and not self.was:
            libc().prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
