"""Worker processes of this host, started with ``subprocess``: the ``subprocess`` launcher.

Processes that are not MPI ranks never inherit the variables an MPI launcher set for this
one: MPI_Init would fail in them.  Workers watch their master with ``master_watch``."""
import json
import os
import socket
import subprocess
import sys
import time

from ... import signals
from ...errors import MasterDied
from ...launcher import RankGone
from . import forked
from .procfs import process_state

STOP_GRACE = 1.0          # a process stopped this long (SIGSTOP, a debugger) is reported
_STATE_EVERY = 0.25       # seconds between reads of /proc/PID/stat
_MPI_ENV = ("PMI_", "PMIX_", "MPI_LOCAL", "MPIR_", "HYDRA_", "OMPI_", "I_MPI_")


def clean_env(env):
    """``env`` without the variables of an MPI launcher."""
    return {k: v for k, v in env.items() if not k.startswith(_MPI_ENV)}


_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def worker_argv(rank):
    """The command line of a worker process (``python -m synkhronos.worker``)."""
    return [sys.executable, "-P", "-m", "synkhronos.worker", json.dumps({"rank": rank})]


def worker_environment(config, device_env):
    """A worker process's environment: this one's, plus its device's variables, the
    session's configuration for it (``SYNK_WORKER_CONFIG``: through the environment, which
    only this user can read, not the command line, which every user can) and this copy of
    synkhronos first on its path."""
    env = dict(os.environ)
    env.update(device_env)
    env["SYNK_WORKER_CONFIG"] = json.dumps(config)
    env["PYTHONPATH"] = os.pathsep.join([_PKG_PARENT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


class SubprocessLauncher:
    """Worker processes on this host, children of the master."""

    def __init__(self):
        self.procs = {}
        self.host = socket.gethostname()
        self._stopped_since = {}
        self._next_state = 0.0

    def start(self, ranks, argv, env_for):
        # each worker in a process group of its own: a launcher that kills its job by
        # process group (MPI's, a batch system's) leaves them the moment to see their master
        # gone and free the session's shared memory; Ctrl-C in a terminal reaches only the
        # master, which stops them
        # (forked by this process's fork server when it can: see forked.py; a Ctrl-C waits
        # until the worker is known, so that stop() finds every worker there is)
        with forked.Adopting():
            for r in ranks:
                env = clean_env(env_for(r))
                server = forked.ForkServer.for_env(env)
                with signals.deferred():
                    proc = server.fork(argv(r)[-1], env) if server is not None else None
                    self.procs[r] = proc or subprocess.Popen(argv(r), env=env, stdin=subprocess.DEVNULL,
                                                             close_fds=True, process_group=0)

    def check(self, leaving=()):
        for r, p in self.procs.items():
            rc = p.poll()
            if rc is not None and not (rc == 0 and r in leaving):   # (a status nobody could read: "is gone")
                raise RankGone(r, returncode=rc if getattr(p, "status_known", True) else None)
        now = time.monotonic()
        if now < self._next_state:
            return
        self._next_state = now + _STATE_EVERY
        for r, p in self.procs.items():
            if p.returncode is not None:        # (left as told: its pid may be another's now)
                continue
            state = process_state(p.pid)
            if state in ("T", "t"):
                since = self._stopped_since.setdefault(r, now)
                if now - since >= STOP_GRACE:
                    raise RankGone(r, stopped=now - since)
            else:
                self._stopped_since.pop(r, None)

    def info(self):
        return [(r, self.host, p.pid) for r, p in sorted(self.procs.items())]

    def stop(self, graceful=True):
        for p in self.procs.values():
            try:
                p.wait(timeout=5.0 if graceful else 0.2)
            except subprocess.TimeoutExpired:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable process
                pass


def master_watch(master_pid):
    """A worker's liveness check of its master (its parent process)."""
    def check():
        if os.getppid() != master_pid:
            raise MasterDied("master process is gone")
    return check
