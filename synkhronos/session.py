"""The master's session: ``fork()`` starts the ranks, ``close()`` stops them, and
``Session.execute`` is the one path by which any command reaches the workers.

A command is sent, the master computes its own share, then the replies are collected; a
worker's failure becomes an exception naming its rank.  The session is robust to being
interrupted at any instant: the command in flight is recorded before it is sent and
finished by the next command (its replies are collected by sequence number, never
confused with the current ones), and state changes of a call are committed on every rank
only once every rank has succeeded (``commit``; workers apply theirs when the next
command tells them to)."""
import _thread
import atexit
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np

from . import backends, flight, signals, timeline
from .debug import DebugMismatch, compare, enabled as debug_enabled, fingerprint
from .errors import Aborted, ForeignSession, StallTimeout, SynkError, WorkerDied, WorkerError, WorkerStopped
from .launcher import RankGone
from .messages import Command
from .rank import Rank, run_share
from .waiting import DEFAULT_STALL, Waiter, env_seconds, spin_seconds

_session = None
IN_WORKER = False  # set by synkhronos.worker


class NestedCall(SynkError):
    """synkhronos was used while another of its calls was in progress on the same thread."""


class _CallLock(_thread.RLock):
    """The session's lock, entered by every public call (``with session.api(): ...``): one
    call at a time; a call made from a signal handler or callback while another call of the
    same thread is in progress is refused (``NestedCall``).  Taken in a signal window, and
    given back by RLock's own exit: C code, where no Ctrl-C can land (a Python ``__exit__``
    can be interrupted at its first line, and the lock then stayed taken: every later call
    of the thread refused as nested, other threads locked out)."""

    def __enter__(self):
        if self._is_owned():
            raise NestedCall("synkhronos was called while another synkhronos call is in progress on this "
                             "thread (from a signal handler or a callback?); the outer call is interrupted. "
                             "Call synkhronos outside of signal handlers.")
        taken = False
        try:
            with signals.deferred():         # (what arrives meanwhile lands as the window closes)
                self.acquire()
                taken = True
                self.session.check_usable(getattr(self.calls, "require", False))
        except BaseException:
            if taken:
                self.release()
            raise
        return self.session


class _Inflight:
    """The command sent last, until all its replies are collected."""

    __slots__ = ("seq", "owed", "replies", "forget", "settle")

    def __init__(self, seq, owed, forget, settle):
        self.seq, self.owed, self.replies = seq, list(owed), {}
        self.forget, self.settle = forget, settle


class Session:
    """State of one fork() … close() session in the master."""

    CHECK_EVERY = 0.002            # seconds between liveness checks outside waits

    def __init__(self, topology, master_rank, profile_workers=False, debug=False, stall=DEFAULT_STALL,
                 timeout=None, spin=None, timeline_path=None):
        self.topology = topology       # backends.Topology: where the ranks run
        self.device = topology.device
        self.n = self.device.n
        self.rank = self.master_rank = master_rank
        self.pid = os.getpid()
        self.profile_workers = profile_workers
        self.debug = debug
        self.debug_log = []            # per command: {rank: fingerprint} (debug mode only)
        self.waiter = Waiter(self._check, stall, timeout, spin=spin)
        self.planes = None             # backends.Planes, once started
        self.launcher = None
        self.me = None                 # the Rank the master acts as
        self.closed = False
        self.distributed = False
        self.functions = []
        self.shared_ids = {}           # id(var) -> registry index
        self.forget = []               # buffer handles workers should drop (piggybacked)
        self.inflight = None
        self.settle = None             # (seq, commit) for the workers, sent with the next command
        self.commands_sent = {}        # command name -> how many were sent
        self.n_data = 0                # Data objects made (their IDs)
        self.scratch = {}              # reusable staging Data of the collectives
        self._next_check = 0.0         # (``_check``)
        self.lock = _CallLock()        # one command at a time, whichever thread calls (``api``)
        self.lock.session, self.lock.calls = self, threading.local()
        self.saved_signals = {}
        self.lengths = LengthCache()
        self.closed_cleanly = False
        self.command_log = {}          # seq -> what it was (the last 64 commands; flight reports)
        self.timeline_path = timeline_path     # where close() writes the timeline (None: off)
        self.timeline_events = timeline.event_limit() if timeline_path else 0    # (ValueError: before any process)
        self.waiter.report = lambda: self.print_flight("synkhronos flight recorder at the stall")

    shareds = property(lambda self: self.me.shareds)

    # ---- life cycle ------------------------------------------------------------------------
    def start(self, timeout):
        settings = dict(sys_path=[p for p in sys.path if p], profile=self.profile_workers, debug=self.debug,
                        stall=self.waiter.stall, timeout=self.waiter.timeout, spin=self.waiter.spin,
                        timeline=self.timeline_events)
        spec = backends.MasterSpec(self.topology, self.master_rank, self.waiter, self._check, settings)

        def env_for(r):
            rank_cfg = cfg if planes.rank_config is None else dict(cfg, **planes.rank_config(r))
            return backends.worker_environment(rank_cfg, self.device.worker_env(r))

        try:
            planes = self.planes = backends.create_master(spec)    # (across hosts: the agents join)
            self.launcher = planes.launcher
            if self.timeline_path is not None:
                timeline.start(self.rank, self.launcher.host, self.timeline_events)
            self.me = Rank(self.rank, self.n, self.master_rank, self.device, planes.control, planes.comm)
            cfg = dict(planes.worker_config, n=self.n, master_rank=self.master_rank, master_pid=self.pid,
                       device=self.device.config(), **settings)
            local = self.me.control.workers if planes.local_workers is None else planes.local_workers
            self.launcher.start(local, backends.worker_argv, env_for)
            self.device.init_master(self.rank, close)
            start_waiter = Waiter(self._check, None, timeout)
            ctl = self.me.control
            errors = {}
            saved, ctl.waiter = ctl.waiter, start_waiter
            try:
                for r, reply in ctl.collect(0, ctl.workers, "start-up"):
                    if reply.status != "ok":
                        errors[r] = reply.value
            finally:
                ctl.waiter = saved
            if errors:
                raise WorkerError(errors, "start-up")
        except RankGone as g:
            err = self._startup_error(g.rank)
            self.shutdown(graceful=False)
            if err is not None:       # it reported why before exiting: show its traceback
                raise WorkerError({g.rank: err}, "start-up") from None
            raise self._lost(g, "start-up") from None
        except StallTimeout as e:
            self.shutdown(graceful=False)
            raise TimeoutError(f"synkhronos: workers did not start within {timeout} s ({e})") from None
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def _startup_error(self, rank):
        """The error a worker that died during start-up replied with, if any."""
        try:
            reply = self.me.control.peek(0, rank)
        except Exception:
            return None
        return reply.value if reply is not None and reply.status != "ok" else None

    def _check(self):
        """Raise RankGone for a lost worker.  Between commands at most every ``CHECK_EVERY``
        seconds (a loss meanwhile is found while the next command waits)."""
        now = time.monotonic()
        if now >= self._next_check:
            self.launcher.check()
            self._next_check = now + self.CHECK_EVERY

    def _lost(self, gone, what):
        host = gone.host
        if gone.stopped is not None:
            return WorkerStopped(gone.rank, gone.stopped, what, host)
        return WorkerDied(gone.rank, gone.returncode, what, host)

    def shutdown(self, graceful=True):
        """Stop the workers (politely first), free every resource, undo thread limits."""
        if self.closed:
            return
        self.closed = True
        me = self.me
        last_words = []
        if me is not None and graceful and me.control.workers and self.launcher.info():
            try:
                leaving = frozenset(me.control.workers)     # each exits once it answered: no loss
                quick = Waiter(lambda: self.launcher.check(leaving), None, 5.0)
                me.control.waiter = quick
                self._finish_inflight("close")
                self._send("quit", ())
                replies = self._collect_all("close")
                self.closed_cleanly = True
                last_words = [getattr(r, "value", None) for r in replies.values()]
            except BaseException:
                pass
        try:
            with signals.deferred():    # all of it: a Ctrl-C half way left it for good (closed)
                if self.launcher is not None:
                    self.launcher.stop(graceful)
                self.device.release_master()
                if me is not None:
                    me.comm.close()
                    me.control.close()
                if self.planes is not None:
                    backends.remove(self.planes, self.closed_cleanly)
        finally:
            signals.unwrap()
            for sig, (previous, ours) in self.saved_signals.items():
                try:
                    if signal.getsignal(sig) is ours:
                        signal.signal(sig, previous)
                except ValueError:
                    pass
            if self.timeline_path is not None:
                self._write_timeline(last_words)
            global _session
            if _session is self:
                _session = None

    # ---- entering the API ------------------------------------------------------------------
    def api(self, require_distributed=False):
        """Entered by every public call (``with session.api(): ...``): one call at a time; a
        call made from a signal handler or callback while another call of this thread is in
        progress is refused."""
        self.lock.calls.require = require_distributed
        return self.lock

    def check_usable(self, require_distributed=False):
        if os.getpid() != self.pid:
            raise ForeignSession(f"this synkhronos session belongs to process {self.pid}; a process "
                                 "forked from it cannot use it (call synk.fork() in the child for a "
                                 "session of its own, before the parent's session exists)")
        if self.closed:
            raise RuntimeError("synkhronos is closed; call synk.fork() first")
        if require_distributed and not self.distributed:
            raise RuntimeError("functions are not distributed yet: call synk.distribute() first")

    # ---- commands --------------------------------------------------------------------------
    def _send(self, name, args, needs=()):
        """Record, then send, command ``name``; returns its sequence number."""
        ctl = self.me.control
        seq = ctl.committed() + 1
        forget, self.forget = self.forget, []
        settle, self.settle = self.settle, None
        self.inflight = _Inflight(seq, ctl.workers, forget, settle)
        self.me.flight.command(seq)
        ctl.send(seq, Command(name, args, forget, settle), needs)
        self.commands_sent[name] = self.commands_sent.get(name, 0) + 1
        return seq

    def _collect_all(self, what):
        inf = self.inflight
        for r, reply in self.me.control.collect(inf.seq, list(inf.owed), what):
            inf.replies[r] = reply
            inf.owed.remove(r)
        self.inflight = None
        return inf.replies

    def _finish_inflight(self, what):
        """Finish the command an interruption left in flight: collect its replies (it is
        never committed), or, if it never reached the workers, take back what it carried."""
        inf = self.inflight
        if inf is None:
            return
        ctl = self.me.control
        if ctl.committed() != inf.seq:         # interrupted before the workers could see it
            self.forget = inf.forget + self.forget
            self.settle = inf.settle
            self.inflight = None
            return
        self._collect_all(f"the interrupted previous command (before {what})")
        self.settle = (inf.seq, False)

    def execute(self, name, args=(), local=None, master_first=False, what=None, patient=False, needs=(),
                after=None):
        """Run command ``name`` on every worker and ``local()`` in the master.

        Returns ``(local_result, {rank: worker_result})``.  A worker exception is raised as
        WorkerError after all ranks are idle again; a lost worker closes the session and
        raises WorkerDied/WorkerStopped/StallTimeout.  With ``master_first`` the master
        computes before the workers start (so that a JIT compile happens once and workers
        load it from the cache).  What ``local()`` or the workers leave pending is dropped
        unless the caller then calls ``commit``.  ``patient`` (distribute, first calls: they
        compile) waits without the session's timeout; stalls are still reported.  ``after``
        runs in the master once the command is sent, after ``local`` (steps that meet the
        other ranks, when ``local`` ran before sending)."""
        if patient and self.waiter.timeout is not None:
            saved, self.waiter.timeout = self.waiter.timeout, None
            try:
                return self.execute(name, args, local, master_first, what, needs=needs, after=after)
            finally:
                self.waiter.timeout = saved
        what = what or name
        me = self.me
        local_result = local_exc = None
        try:
            self._finish_inflight(what)
            self._check()
            me.drop()              # an interrupted command's share (held, never sent) is dropped
            me.seq = me.control.committed() + 1
            if master_first and local is not None:
                # the first call compiles: a Ctrl-C inside LLVM can crash the process, so
                # signals wait until the compile is done (``busy`` shows that it is alive)
                with signals.deferred():
                    local_result = run_share(me, local)
                local = None
            if name != "call":
                self.lengths.clear()          # a collective may change workers' lengths
            if self.debug:
                fp = fingerprint(me.seq, name, args, me.shareds)
            seq = self._send(name, args, needs)
            self.log_command(seq, what)
            self.settle = (seq, False)
            if local is not None or after is not None:
                try:
                    if local is not None:
                        local_result = run_share(me, local)
                    if after is not None:
                        run_share(me, after)
                except (RankGone, StallTimeout):
                    raise
                except BaseException as e:
                    me.control.abort(seq)     # workers leave their barriers and votes
                    if _is_interrupt(e):
                        raise
                    # kept until the command ends: its finished frames' locals go now (their
                    # views of shared memory would keep a segment replaced later mapped, the
                    # exception and this frame being a cycle that only the collector breaks)
                    traceback.clear_frames(e.__traceback__)
                    local_exc = e
            try:
                replies = self._collect_all(what)
            except (RankGone, StallTimeout):
                raise
            except BaseException:              # interrupted: collected by the next command
                me.control.abort(seq)
                raise
        except RankGone as g:
            self.print_flight(f"synkhronos flight recorder when rank {g.rank} was lost during {what}")
            self._close_after_loss()
            signals.release()
            raise self._lost(g, what) from None
        except StallTimeout:
            self.print_flight(f"synkhronos flight recorder at the timeout during {what}")
            self._close_after_loss()
            signals.release()
            raise
        except BaseException as e:
            inf = self.inflight            # interrupted with a command out (anywhere after its send):
            if inf is not None and me.control.committed() == inf.seq:
                me.control.abort(inf.seq)  # the ranks must leave it (collected by the next command)
            signals.release()
            signals.restore_interrupt(e)
            raise
        signals.release()            # held since a commit: the command is complete everywhere
        self.me.flight.done(seq)
        errors = {r: rep.value for r, rep in replies.items() if rep.status == "err"}
        if self.debug:
            fps = {**{r: rep.fingerprint for r, rep in replies.items()}, self.rank: fp}
            self.debug_log.append(fps)
            try:
                compare(self.rank, fps)
            except DebugMismatch as e:
                raise e from (WorkerError(errors, what) if errors else local_exc)
        if isinstance(local_exc, Aborted) and errors:
            local_exc = None            # the master only stopped because a worker failed
        if local_exc is not None:
            signals.restore_interrupt(local_exc)
            if errors:
                raise local_exc from WorkerError(errors, what)
            raise local_exc
        if errors:
            raise WorkerError(errors, what)
        return local_result, {r: rep.value for r, rep in replies.items()}

    def commit(self):
        """Apply what the last command left pending, on every rank: here now, in the workers
        when the next command arrives.  Called once the command fully succeeded."""
        settle = self.settle
        if settle is None or settle[1]:
            return
        if self.me.pending is None:
            self.settle = (settle[0], True)          # one assignment: nothing to split
            return
        with signals.deferred():
            self.settle = (settle[0], True)
            self.me.settle(self.settle)

    def _write_timeline(self, workers):
        try:
            path = timeline.write_trace(self.timeline_path, workers)
        except OSError as e:
            print(f"synkhronos: could not write the timeline to {self.timeline_path}: {e}", file=sys.stderr)
            return
        if path is not None:
            missing = timeline.missing(self.n, self.rank, workers)
            lacks = f"; rank(s) {missing} sent no events (they did not answer the close)" if missing else ""
            print(f"synkhronos: timeline of {self.n} rank(s) written to {path} (open it in "
                  f"https://ui.perfetto.dev or chrome://tracing){lacks}", file=sys.stderr, flush=True)

    def log_command(self, seq, what):
        """Remember what command ``seq`` was (the flight report names it); the last 64."""
        log = self.command_log
        log[seq] = what
        tl = timeline.current()
        if tl is not None:
            tl.label(seq, what)
        if len(log) > 64:
            del log[next(iter(log))]

    def flights(self, wait=0.3):
        """Every rank's ``flight.RankFlight`` (the other hosts' awaited ``wait`` seconds)."""
        if self.planes is None or self.closed:
            return []
        return self.me.control.flights(wait=wait, host=self.launcher.host)

    def print_flight(self, title="synkhronos flight recorder", wait=0.3):
        """Print every rank's state, and what each waits for (on a stall, a loss, SIGUSR1)."""
        try:
            text = flight.report(self.flights(wait), self.command_log, title)
            print(text, file=sys.stderr, flush=True)
        except Exception as e:        # (a report must never hide what caused it)
            print(f"synkhronos: no flight report ({type(e).__name__}: {e})", file=sys.stderr, flush=True)

    def _close_after_loss(self):
        try:
            self.me.control.abort()
        except Exception:
            pass
        self.shutdown(graceful=False)


def _is_interrupt(e):
    return isinstance(e, (KeyboardInterrupt, SystemExit, NestedCall)) or signals.as_interrupt(e) is not None


class LengthCache:
    """Every rank's lengths of sets of sliceable shared variables, as last read.  Workers'
    lengths change only through synkhronos commands, so the cache is cleared by every
    command that may change them."""

    def __init__(self):
        self._d = {}

    def get(self, key):
        return self._d.get(key)

    def put(self, key, lengths):
        self._d[key] = lengths

    def clear(self):
        self._d.clear()


def get_session(require_distributed=False):
    """The active session, or a RuntimeError saying what to call first."""
    session = _session
    if session is None or session.closed:
        raise RuntimeError("synkhronos is not forked: call synk.fork() first")
    session.check_usable(require_distributed)
    return session


def fork(n_parallel=None, use_gpu=None, master_rank=0, profile_workers=False,
         max_n_var=None, max_dim=None, timeout=None, debug=None, stall=None, mode=None,
         start_timeout=120.0, spin=None, matmul_precision=None, timeline=None):
    """Start one worker process per extra device; the master process is rank ``master_rank``.

    ``n_parallel=None`` uses every usable device (CPU cores here); each process gets its
    share of BLAS/numba threads.  ``use_gpu=None`` means GPUs if present, else CPU.
    ``max_n_var`` and ``max_dim`` are accepted for compatibility and not needed (no fixed-size
    buffers).  ``debug`` (default: env ``SYNK_DEBUG``) fingerprints every command on every
    rank and reports the first rank that disagrees (see ``synkhronos.debug``).

    Waiting for other ranks: a stopped or dead rank is reported at once; a wait longer than
    ``stall`` seconds (default: env ``SYNK_STALL``, else 60; 0 disables) prints a warning
    naming the ranks still owed; with ``timeout`` (default: env ``SYNK_TIMEOUT``, else none)
    a wait that long raises ``StallTimeout`` and closes the session (except in distribute()
    and the first call of each function, which compile: they only warn).  ``start_timeout``
    bounds the workers' start-up.  ``mode`` (default: env ``SYNK_MODE``): PyTensor's
    compile mode for the ranks, None (numba) or "JAX"; GPUs always use JAX.  ``spin``
    (default: env ``SYNK_SPIN``, else 0.0002): seconds a waiting rank polls before it
    sleeps; longer wakes faster after pauses between calls, at that much CPU per wait.
    ``matmul_precision`` (JAX ranks; default: JAX's own setting in the master, e.g. env
    ``JAX_DEFAULT_MATMUL_PRECISION``): the precision of float32 matmuls in every rank,
    "highest" for full float32 where JAX's default on Ampere/Hopper GPUs is TF32.
    ``timeline`` (default: env ``SYNK_TIMELINE``): a path where ``close()`` writes a
    Chrome/Perfetto trace of every rank (``synkhronos.timeline``).
    Returns the number of ranks."""
    global _session
    if IN_WORKER:
        raise RuntimeError("synk.fork() cannot be called inside a synkhronos worker")
    if _session is not None and not _session.closed and _session.pid == os.getpid():
        raise RuntimeError("synkhronos is already forked; call synk.close() before forking again")
    stall = _seconds(stall, "stall", "SYNK_STALL", DEFAULT_STALL)
    timeout = _seconds(timeout, "timeout", "SYNK_TIMEOUT", None)
    spin = spin_seconds(spin)
    if mode is None:
        mode = os.environ.get("SYNK_MODE") or None
    topology = backends.plan(n_parallel, use_gpu, mode, _close_open_session, matmul_precision)
    device = topology.device
    if isinstance(master_rank, (bool, np.bool_)) or not isinstance(master_rank, (int, np.integer)) \
            or not 0 <= master_rank < device.n:
        raise ValueError(f"master_rank must be an int in [0, {device.n - 1}], got {master_rank!r}")
    master_rank = int(master_rank)
    backends.reap(topology.name)
    timeline_path = timeline or os.environ.get("SYNK_TIMELINE") or None
    session = Session(topology, master_rank, profile_workers, debug_enabled(debug), stall, timeout, spin,
                      timeline_path)
    _session = session
    _exit_on_termination(session)    # before the start: a SIGTERM during it cleans up too
    try:
        session.start(start_timeout)
    except BaseException:
        _session = None
        raise
    print(f"Synkhronos: {device.describe()}, master rank {master_rank}.", flush=True)
    return device.n


def _seconds(value, name, env, default):
    if value is None:
        return env_seconds(env, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name} must be a non-negative number of seconds (0: none) or None, got {value!r}")
    return float(value) or None


def _exit_on_termination(session):
    """SIGTERM/SIGHUP (a cancelled job, a closed terminal) would kill the master without
    running close(); turn them into SystemExit so close() removes the workers and buffers.
    SIGUSR1 prints the flight report (what every rank is doing: ``kill -USR1 <master>`` on
    a job that seems stuck).  Only default handlers are replaced, and close() restores them."""
    saved = {}
    handlers = {signal.SIGTERM: _raise_exit, signal.SIGHUP: _raise_exit, signal.SIGUSR1: _print_flight}
    for sig, handler in handlers.items():
        try:
            if signal.getsignal(sig) is signal.SIG_DFL:
                saved[sig] = (signal.signal(sig, handler), handler)
        except ValueError:          # not the main thread: leave signals alone
            pass
    session.saved_signals = saved


def _print_flight(signum, frame):
    """SIGUSR1: the flight report of this process's session (no message to other hosts from
    a signal handler: theirs as last received)."""
    session = _session
    if session is not None and not session.closed:
        session.print_flight("synkhronos flight recorder (SIGUSR1)", wait=0.0)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def last():
    """This process's session, open or closing, or None (none, or its parent's after a fork)."""
    session = _session
    return session if session is not None and session.pid == os.getpid() else None


def current():
    """This process's open session, or None."""
    session = last()
    return None if session is None or session.closed else session


def close():
    """Stop and join the workers and free every shared resource.  Runs at exit.

    In a process forked from the session's (``os.fork``, multiprocessing), it does nothing:
    the session is the parent's."""
    session = _session
    if session is not None and session.pid == os.getpid():
        session.lock.acquire()          # (the lock itself: not a call, which a closed session refuses)
        try:
            session.shutdown(graceful=True)
        finally:
            session.lock.release()


def _close_open_session():
    """Close this process's session; whether there was one (at exit of an MPI job)."""
    session = _session
    if session is None or session.pid != os.getpid():
        return False
    close()
    return True


atexit.register(close)
