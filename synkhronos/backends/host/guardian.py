"""The guardian of a master that has no worker on its host (``fork(1)``, or one rank a host
under ``mpiexec``): a small process that frees the session's shared memory on that host,
MPICH's files included, if the master dies without closing its session.  On a host with
workers they do it (``backends.worker_exit``); here nobody else is left to.

The process (this file run by path: ``python -I -S guardian.py MASTER PREFIX [FILE...]``,
the standard library only) waits on a pipe from the master: ``closed`` means the master
closed its session; the end of the pipe without it (the master died), or the master seen
gone (a process that the master forked may still hold the pipe), means free it."""
import os
import select
import signal
import subprocess
import sys

SHM_DIR = "/dev/shm"
_LOOK_S = 1.0            # how often the guardian looks whether its master is still alive
_CLOSED = b"closed"


class Guardian:
    """The master's side: ``start`` the process, ``release`` it when the session closes."""

    def __init__(self, proc):
        self.proc = proc

    @classmethod
    def start(cls, prefix, files=()):
        """A guardian of this process's session ``prefix`` (and of ``files`` in /dev/shm), or
        None if none could be started (the session runs without one)."""
        argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), prefix, *files]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    start_new_session=True, close_fds=True)
        except OSError:
            return None
        return cls(proc)

    def release(self):
        """The session was closed by its master: the guardian exits with nothing to free."""
        try:
            self.proc.stdin.write(_CLOSED)
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def free(prefix, files):
    """Unlink every segment and semaphore of session ``prefix`` and the named ``files``."""
    base = prefix.lstrip("/") + "_"
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return
    for entry in entries:
        if entry.startswith(base) or entry.startswith("sem." + base) or entry in files:
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
            except OSError:
                pass


def watch(master, prefix, files):
    """Wait for the master's word or its end; free what it left unless it closed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # a Ctrl-C is the master's to handle
    said = b""
    while True:
        ready, _, _ = select.select([0], [], [], _LOOK_S)
        if ready:
            chunk = os.read(0, 64)
            if not chunk:
                break
            said += chunk
            if said == _CLOSED:      # (at once: a process the master forked may keep the pipe open)
                return
        elif os.getppid() != master:
            break
    if said != _CLOSED:
        free(prefix, set(files))


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
