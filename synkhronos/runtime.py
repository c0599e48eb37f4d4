"""The master's runtime: starts worker processes, runs commands on all ranks, closes.

``fork()`` starts one worker process per extra device (the master is a rank too), ``close()``
stops them and removes every shared-memory segment; ``Runtime.execute`` is the one path by
which any command reaches the workers: send, do the master's share, collect the replies,
and turn a worker's failure into an exception naming its rank."""
import atexit
import json
import signal
import os
import subprocess
import sys
import threading
import time

import posix_ipc

from . import shm
from .debug import DebugMismatch, compare, fingerprint
from .debug import enabled as debug_enabled
from .device import select_device
from .errors import Aborted, WorkerDied, WorkerError
from .transport import ShmTransport, reap_stale_sessions

_runtime = None
IN_WORKER = False  # set by synkhronos.worker


class _Dead(Exception):
    def __init__(self, rank, returncode):
        self.rank, self.returncode = rank, returncode


class Runtime:
    """State of one fork() … close() session in the master."""

    def __init__(self, device, master_rank, profile_workers=False, debug=False):
        self.device = device
        self.n = device.n
        self.rank = master_rank
        self.master_rank = master_rank
        self.prefix = shm.new_prefix()
        self.profile_workers = profile_workers
        self.debug = debug
        self.debug_log = []            # per command: {rank: fingerprint} (debug mode only)
        self.procs = {}
        self.transport = None
        self.closed = False
        self.distributed = False
        self.functions = []
        self.shareds = []          # registry: index -> pytensor shared variable
        self.shared_ids = {}       # id(var) -> index
        self.forget = []           # segment names workers should drop (piggybacked)
        self.inflight = False
        self.owed, self.replies = set(), {}   # ranks that still owe a reply to the command in flight
        self.n_data = 0
        self.lock = threading.RLock()  # one command at a time, whichever thread calls
        self.sliceable_lengths = {}   # tuple of var ids -> per-rank lengths (cache)

    # ---- life cycle ------------------------------------------------------------------
    def start(self, timeout):
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cfg = dict(prefix=self.prefix, n=self.n, master_rank=self.master_rank,
                   master_pid=os.getpid(), device=self.device.kind,
                   sys_path=[p for p in sys.path if p], profile=self.profile_workers,
                   debug=self.debug)
        try:
            self.transport = ShmTransport(self.prefix, self.n, self.rank, self.master_rank, create=True)
            for r in self.transport.workers:
                env = dict(os.environ)
                env.update(self.device.worker_env(r))
                # the session's names go through the environment, which only this user can
                # read (/proc/PID/environ), not the command line, which every user can
                env["SYNK_WORKER_CONFIG"] = json.dumps(cfg)
                env["PYTHONPATH"] = os.pathsep.join(
                    [pkg_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
                self.procs[r] = subprocess.Popen(
                    [sys.executable, "-P", "-m", "synkhronos.worker", json.dumps({"rank": r})],
                    env=env, stdin=subprocess.DEVNULL, close_fds=True)
            self.device.init_master(self.rank)
            deadline = time.monotonic() + timeout
            errors = {}
            for r in self.transport.workers:
                self.transport.wait_done(r, self._alive_fn(deadline, "start-up"))
                status, payload = self.transport.read_reply(r)
                if status != "ok":
                    errors[r] = payload
            if errors:
                raise WorkerError(errors, "start-up")
        except _Dead as d:
            err = self._startup_error(d.rank)
            self.shutdown(graceful=False)
            if err is not None:       # it reported why before exiting: show its traceback
                raise WorkerError({d.rank: err}, "start-up") from None
            raise WorkerDied(d.rank, d.returncode, "start-up") from None
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def _startup_error(self, rank):
        """The error a worker that died during start-up replied with, if any."""
        try:
            if self.transport.done[rank].value > 0:
                status, payload = self.transport.read_reply(rank)
                return payload if status != "ok" else None
        except Exception:
            pass
        return None

    def _alive_fn(self, deadline=None, what="command"):
        procs = self.procs

        def alive():
            for r, p in procs.items():
                rc = p.poll()
                if rc is not None:
                    raise _Dead(r, rc)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"synkhronos: workers did not answer in time during {what}")
            return True
        return alive

    def alive_check(self):
        return self._alive_fn()()

    def shutdown(self, graceful=True):
        """Stop the workers (politely first), free every segment, undo thread limits."""
        if self.closed:
            return
        self.closed = True
        t = self.transport
        if t is not None and graceful and self.procs:
            try:
                if self.inflight:
                    try:
                        self._collect(time.monotonic() + 5.0)
                    except TimeoutError:
                        pass
                self.owed = set(t.workers)
                t.send(("quit", (), []))
                self._collect(time.monotonic() + 5.0)
            except BaseException:
                pass
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
        self.device.release_master()
        for sig, handler in getattr(self, "saved_signals", {}).items():
            try:
                if signal.getsignal(sig) is _raise_exit:
                    signal.signal(sig, handler)
            except ValueError:
                pass
        if t is not None:
            t.close()
        shm.remove_all(self.prefix)
        global _runtime
        if _runtime is self:
            _runtime = None

    # ---- commands --------------------------------------------------------------------
    def check_alive(self):
        if self.closed:
            raise RuntimeError("synkhronos is closed; call synk.fork() first")
        try:
            self._alive_fn()()
        except _Dead as d:
            self.shutdown(graceful=False)
            raise WorkerDied(d.rank, d.returncode) from None

    def _collect(self, deadline=None, what="command"):
        """Wait for the replies still owed for the command in flight; return {rank: reply}.

        A reply read before an interruption is kept, so an interrupted collect resumes
        where it stopped instead of waiting for a reply that was already consumed."""
        alive = self._alive_fn(deadline, what)
        for r in sorted(self.owed):
            self.transport.wait_done(r, alive)
            self.replies[r] = self.transport.read_reply(r)
            self.owed.discard(r)
        self.inflight = False
        return self.replies

    def execute(self, name, args=(), local=None, master_first=False, what=None):
        """Run command ``name`` on every worker and ``local()`` in the master.

        Returns ``(local_result, {rank: worker_result})``.  A worker exception is raised as
        WorkerError after all ranks are idle again; a dead worker closes the runtime and
        raises WorkerDied.  With ``master_first`` the master computes before the workers
        start (so that a JIT compile happens once and workers load it from the cache)."""
        with self.lock:
            return self._execute(name, args, local, master_first, what or name)

    def _execute(self, name, args, local, master_first, what):
        if self.closed:
            raise RuntimeError("synkhronos is closed; call synk.fork() first")
        t = self.transport
        local_result = local_exc = None
        try:
            if self.inflight:            # a previous command was interrupted (Ctrl-C)
                self._collect(what="the interrupted previous command")
                t.drain()
            self._alive_fn()()
            if master_first and local is not None:
                local_result = local()
                local = None
            if name != "call":
                self.sliceable_lengths.clear()     # a collective may change workers' lengths
            forget, self.forget = self.forget, []
            if self.debug:
                fp = fingerprint(t.seq + 1, name, args, self.shareds)
            t.send((name, args, forget))
            self.inflight = True
            self.owed, self.replies = set(t.workers), {}
            if local is not None:
                try:
                    local_result = local()
                except (KeyboardInterrupt, SystemExit, posix_ipc.SignalError):
                    t.abort()            # workers leave their barriers; collected next time
                    raise
                except BaseException as e:  # keep the protocol in step: collect first
                    local_exc = e
                    t.abort()
            try:
                replies = self._collect(what=what)
            except _Dead:
                raise
            except BaseException:        # interrupted (Ctrl-C, a signal, a timeout)
                t.abort()
                raise
        except _Dead as d:
            try:
                t.abort()
            finally:
                self.shutdown(graceful=False)
            raise WorkerDied(d.rank, d.returncode, what) from None
        errors = {r: rep[1] for r, rep in replies.items() if rep[0] == "err"}
        if t.aborted() or errors or local_exc is not None:
            t.drain()
        if self.debug:
            fps = {r: rep[2] if len(rep) > 2 else None for r, rep in replies.items()}
            fps[self.rank] = fp
            self.debug_log.append(fps)
            try:
                compare(self.rank, fps)
            except DebugMismatch as e:
                raise e from (WorkerError(errors, what) if errors else local_exc)
        if isinstance(local_exc, Aborted) and errors:
            local_exc = None            # the master only stopped because a worker failed
        if local_exc is not None:
            if errors:
                raise local_exc from WorkerError(errors, what)
            raise local_exc
        if errors:
            raise WorkerError(errors, what)
        return local_result, {r: rep[1] for r, rep in replies.items()}


def get_runtime(require_distributed=False):
    """The active runtime, or a RuntimeError saying what to call first."""
    rt = _runtime
    if rt is None or rt.closed:
        raise RuntimeError("synkhronos is not forked: call synk.fork() first")
    if require_distributed and not rt.distributed:
        raise RuntimeError("functions are not distributed yet: call synk.distribute() first")
    return rt


def fork(n_parallel=None, use_gpu=None, master_rank=0, profile_workers=False,
         max_n_var=None, max_dim=None, timeout=120.0, debug=None):
    """Start one worker process per extra device; the master process is rank ``master_rank``.

    ``n_parallel=None`` uses every usable device (CPU cores here); each process gets its
    share of BLAS/numba threads.  ``use_gpu=None`` means GPUs if present, else CPU.
    ``max_n_var`` and ``max_dim`` are accepted for compatibility and not needed (no fixed-size
    buffers).  ``debug`` (default: env ``SYNK_DEBUG``) fingerprints every command on every
    rank and reports the first rank that disagrees (see ``synkhronos.debug``).
    Returns the number of ranks."""
    global _runtime
    if IN_WORKER:
        raise RuntimeError("synk.fork() cannot be called inside a synkhronos worker")
    if _runtime is not None and not _runtime.closed:
        raise RuntimeError("synkhronos is already forked; call synk.close() before forking again")
    device = select_device(n_parallel, use_gpu)
    reap_stale_sessions()
    if isinstance(master_rank, bool) or not isinstance(master_rank, int) or not 0 <= master_rank < device.n:
        raise ValueError(f"master_rank must be an int in [0, {device.n - 1}], got {master_rank!r}")
    rt = Runtime(device, master_rank, profile_workers, debug_enabled(debug))
    _runtime = rt
    try:
        rt.start(timeout)
    except BaseException:
        _runtime = None
        raise
    _exit_on_termination(rt)
    print(f"Synkhronos: {device.describe()}, master rank {master_rank}.", flush=True)
    return device.n


def _exit_on_termination(rt):
    """SIGTERM/SIGHUP (a cancelled job, a closed terminal) would kill the master without
    running close(); turn them into SystemExit so close() removes the workers and segments.
    Only default handlers are replaced, and they are restored by close()."""
    saved = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) is signal.SIG_DFL:
                saved[sig] = signal.signal(sig, _raise_exit)
        except ValueError:          # not the main thread: leave signals alone
            pass
    rt.saved_signals = saved


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def debug_log():
    """Fingerprints of every command so far ({rank: fingerprint} each), in debug mode."""
    rt = _runtime
    return [] if rt is None else list(rt.debug_log)


def close():
    """Stop and join the workers and free every shared-memory segment.  Runs at exit."""
    rt = _runtime
    if rt is not None:
        rt.shutdown(graceful=True)


atexit.register(close)
