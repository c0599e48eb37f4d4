"""Fault injection for the synkhronos tests: a misbehaving Op, start-up faults, and master
scripts run as subprocesses (Ctrl-C, SIGKILL of the master).

1. ``Fault(action, rank, when)``: a test-only PyTensor Op (identity on a float vector) that,
   in worker process ``rank`` (never in the master), raises ``FaultInjected``, SIGKILLs its
   own process, or calls ``synk.fork()``:

   * ``when="unpickle"``: while the worker unpickles the functions at ``synk.distribute()``
     (``__setstate__``);
   * ``when="perform"``: while computing, only if its shard holds ``TRIGGER`` (the fault is
     data-dependent: the same function works on clean data);
   * ``action="sleep"`` sleeps ``SLEEP_S`` seconds in *every* rank whose shard holds
     ``TRIGGER``, the master included: a long call to interrupt.

   The Op lives in this module, which workers can import (the master passes its
   ``sys.path`` on), so it pickles.  PyTensor's numba backend has no implementation for it
   and runs ``perform`` in object mode (a warning, silenced by ``quiet()``).

2. ``startup_fault_env(tmp_path, spec)``: environment that makes worker processes fail while
   starting (before they answer the master): a ``sitecustomize`` module put on PYTHONPATH
   (which the master hands to its workers).  ``spec`` is ``"kill:R"`` (SIGKILL itself),
   ``"raise:R"`` (``import pytensor`` fails, as with a bad ``PYTENSOR_FLAGS``) or
   ``"sleep:R:S"`` (start S seconds late), for worker rank R; several specs joined by ``,``.

3. ``python _fault_scripts.py SCENARIO``: master programs for the Ctrl-C and master-kill
   tests.  They print one line ``SYNK-INFO {json}`` when the session is up and one line
   ``SYNK-RESULT {json}`` at the end."""
import json
import os
import signal
import sys
import time
import warnings

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

TRIGGER = -12345.0
SLEEP_S = 2.0


class FaultInjected(RuntimeError):
    """Raised by a Fault op in the chosen rank."""


def worker_rank():
    """This process's synkhronos rank if it is a worker, else None (the master)."""
    import synkhronos.session as r
    if not r.IN_WORKER:
        return None
    try:
        return int(json.loads(sys.argv[1])["rank"])
    except Exception:  # pragma: no cover
        return None


def _act(action, where):
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)              # pragma: no cover - not reached
    if action == "fork":
        import synkhronos as synk
        synk.fork(2)                # must raise RuntimeError inside a worker
        raise AssertionError("synk.fork() inside a worker did not raise")  # pragma: no cover
    raise FaultInjected(f"synk-fault injected in rank {worker_rank()} at {where}")


class Fault(Op):
    __props__ = ("action", "rank", "when")

    def __init__(self, action="raise", rank=1, when="perform"):
        assert action in ("raise", "kill", "sleep", "fork") and when in ("perform", "unpickle")
        self.action, self.rank, self.when = action, rank, when

    def make_node(self, x):
        from pytensor.tensor import as_tensor_variable
        x = as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, output_storage):
        (x,) = inputs
        if self.when == "perform" and np.any(x == TRIGGER):
            if self.action == "sleep":
                time.sleep(SLEEP_S)
            elif worker_rank() == self.rank:
                _act(self.action, "perform")
        output_storage[0][0] = np.array(x, copy=True)

    def __setstate__(self, state):
        self.__dict__.update(state)
        if state.get("when") == "unpickle" and worker_rank() == state.get("rank"):
            _act(state["action"], "unpickle")


class Lag(Op):
    """Rank ``rank`` sleeps ``seconds`` before passing its value on (a slow rank)."""
    __props__ = ("rank", "seconds")

    def __init__(self, rank=1, seconds=0.002):
        self.rank, self.seconds = rank, seconds

    def make_node(self, x):
        from pytensor.tensor import as_tensor_variable
        x = as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, output_storage):
        if worker_rank() == self.rank:
            time.sleep(self.seconds)
        output_storage[0][0] = np.array(inputs[0], copy=True)


def _register_jax():
    """JAX conversions of ``Fault`` and ``Lag`` (their ``perform`` as a host callback), so
    that the same faults run on JAX ranks: when this process runs JAX (a JAX rank, or a
    master with ``SYNK_MODE=JAX``)."""
    if not ("jax" in sys.modules or os.environ.get("SYNK_MODE", "").strip().upper() == "JAX"):
        return
    import jax
    from pytensor.link.jax.dispatch import jax_funcify

    def as_callback(op, **kwargs):
        def host(x):
            x = np.asarray(x)
            out = [[None]]
            op.perform(None, [x], out)
            return np.asarray(out[0][0], x.dtype)
        return lambda x: jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    jax_funcify.register(Fault)(as_callback)
    jax_funcify.register(Lag)(as_callback)


class AtExit(Op):
    """In a worker: registers an exit handler that writes ``<SYNK_TEST_EXIT_DIR>/rank<r>``
    and leaves a line in stdout's buffer (not flushed): what a worker's exit must
    still honour."""
    __props__ = ()

    def make_node(self, x):
        from pytensor.tensor import as_tensor_variable
        x = as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, output_storage):
        r = worker_rank()
        if r is not None:
            import atexit
            path = os.path.join(os.environ["SYNK_TEST_EXIT_DIR"], f"rank{r}")
            atexit.register(lambda: open(path, "w").close())
            sys.stdout.write(f"unflushed words of rank {r}\n")   # a pipe: block-buffered
        output_storage[0][0] = np.array(inputs[0], copy=True)


_register_jax()


def quiet():
    """Silence PyTensor's 'Numba will use object mode' warning for Fault."""
    warnings.filterwarnings("ignore", message=".*Numba will use object mode.*")


def report(config, text):
    """Print ``text`` on the terminal even while pytest captures output (the figures the
    fault, soak and fuzz tests measure)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        print(text)
        return
    with capman.global_and_fixture_disabled():
        print(text, flush=True)


def with_trigger(values, rank, n):
    """A copy of ``values`` (1-D) with TRIGGER in the first row of ``rank``'s shard."""
    from synkhronos.shards import split
    v = np.array(values, dtype=np.float64, copy=True)
    b = split(len(v), n)
    assert b[rank + 1] > b[rank], "that rank has no rows"
    v[b[rank]] = TRIGGER
    return v


# ------------------------------------------------------------------------------------------
# Start-up faults

_SITECUSTOMIZE = '''
import json, os, sys, time
_spec = os.environ.get("SYNK_TEST_STARTUP_FAULT")
with open("/proc/self/cmdline", "rb") as _fh:
    _server = b"synkhronos.backends.host.forkserver" in _fh.read()
if _spec and _server:
    # the fork server: its workers never run this file; arm each one as it is forked
    if "server" in _spec.split(","):
        os.kill(os.getpid(), 9)

    def _arm():
        w = sys.modules.get("synkhronos.worker")
        if w is None or getattr(w.main, "armed", False):
            return
        inner = w.main

        def main():
            rank = json.loads(sys.argv[1])["rank"]
            for one in _spec.split(","):
                parts = one.split(":")
                if len(parts) < 2 or rank != int(parts[1]):
                    continue
                if parts[0] == "kill":
                    os.kill(os.getpid(), 9)
                elif parts[0] == "raise":
                    sys.modules["pytensor"] = None      # its import in the worker's set-up fails
                elif parts[0] == "sleep":
                    time.sleep(float(parts[2]))
            return inner()
        main.armed = True
        w.main = main
    os.register_at_fork(after_in_child=_arm)
elif _spec:
    try:
        with open("/proc/self/cmdline", "rb") as _fh:
            _argv = _fh.read().split(b"\\0")
        _rank = json.loads(_argv[_argv.index(b"synkhronos.worker") + 1])["rank"]
    except Exception:
        _rank = None
    for _one in _spec.split(","):
        _parts = _one.split(":")
        if _rank is None or len(_parts) < 2 or _rank != int(_parts[1]):
            continue
        if _parts[0] == "kill":
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        elif _parts[0] == "raise":
            os.environ["PYTENSOR_FLAGS"] = "floatX=synk_fault_injected"
        elif _parts[0] == "sleep":
            time.sleep(float(_parts[2]))
'''


def startup_fault_env(tmp_path, spec, forked=True):
    """{env var: value} that makes the workers named in ``spec`` fail at start-up (``kill:R``,
    ``raise:R``, ``sleep:R:S``; ``server``: the fork server dies as it starts), forked by the
    fork server or (``forked=False``) spawned."""
    d = tmp_path / "synk_sitecustomize"
    d.mkdir(exist_ok=True)
    (d / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(d) + (os.pathsep + old if old else ""),
            "SYNK_TEST_STARTUP_FAULT": spec, "SYNK_FORK_SERVER": "1" if forked else "0"}


# ------------------------------------------------------------------------------------------
# Master programs (run as ``python _fault_scripts.py SCENARIO``)


def _emit(kind, kw):
    """A line for the test: on stdout, and (the output of two hosts can interleave) in
    the file ``SYNK_RESULT_FILE`` when set (a scenario under ``mpiexec``)."""
    line = f"{kind} " + json.dumps(kw, default=str)
    print(line, flush=True)
    path = os.environ.get("SYNK_RESULT_FILE")
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")


def _info(**kw):
    _emit("SYNK-INFO", kw)


def _result(**kw):
    _emit("SYNK-RESULT", kw)


def _session(n):
    """fork(n); a function whose Fault op sleeps where the data holds TRIGGER (it also
    reads ``w``, so that collectives know ``w``).  Returns (f, w, rt)."""
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    import _fault_scripts as fs        # the importable module (this file runs as __main__)
    fs.quiet()
    synk.fork(n)
    x = T.vector("x", dtype="float64")
    w = pytensor.shared(np.zeros(1000), name="w")
    g = synk.function([x], [(T.sum(fs.Fault("sleep")(x)), "sum"), (T.sum(w), None)])
    synk.distribute()

    def f(data):
        return g(data)[0]
    assert f(np.arange(6.0)) == 15.0
    return f, w, synk.session_info()


def _ctrl_c_later(delay):
    """Ctrl-C as a terminal sends it: SIGINT to the whole process group, after ``delay``."""
    import threading

    def fire():
        # this thread must not take the signal itself: the main thread is the one to stop
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        os.killpg(os.getpgrp(), signal.SIGINT)
    t = threading.Timer(delay, fire)
    t.daemon = True
    t.start()
    return t


def _watchdog(res, limit):
    """If the program is still running after ``limit`` seconds: report what it has (with
    ``hung`` set to the step it was in) and exit at once; the workers then see their master
    gone, exit and remove the session's segments."""
    import threading

    def fire():
        res["hung"] = res.get("step")
        _result(**res)
        os._exit(3)
    t = threading.Timer(limit, fire)
    t.daemon = True
    t.start()
    return t


def scenario_ctrl_c(where, then):
    """Ctrl-C while the master computes its own long share (``where="master"``), while it
    waits for a worker's long share (``"worker"``), or while it waits in all_reduce for a
    stopped worker (``"barrier"``); ``then`` is ``"continue"`` (use the runtime again) or
    ``"close"``."""
    import synkhronos as synk
    import synk_testutil as tu
    n = 3
    f, w, info = _session(n)
    prefix, pids = info.resources["shm_prefix"], list(tu.worker_pids().values())
    _info(prefix=prefix, pids=pids)
    res = dict(prefix=prefix, pids=pids, step="call")
    victim = tu.pid_of(2)
    before = [np.full(1000, float(r + 1)) for r in range(n)]
    for r in range(n):
        synk.set_value(r, w, before[r])
    if where == "barrier":
        os.kill(victim, signal.SIGSTOP)
        data = None
    else:
        data = with_trigger(np.ones(6), 0 if where == "master" else 2, n)
    _ctrl_c_later(0.5)
    t0 = time.monotonic()
    try:
        if data is None:
            synk.all_reduce(w, op="sum")
        else:
            f(data)
        res["interrupted"] = False
    except KeyboardInterrupt:
        res["interrupted"] = True
    res["ki_s"] = time.monotonic() - t0
    if where == "barrier":
        time.sleep(0.2)
        os.kill(victim, signal.SIGCONT)
    res["closed_after_ki"] = not tu.is_open()
    # (a hang detector: each step's time is checked on its own; room for a loaded machine)
    _watchdog(res, 2 * SLEEP_S + 4.0)
    if then == "continue":
        res["step"] = "next command"
        t0 = time.monotonic()
        res["next_result"] = float(f(np.arange(6.0)))
        res["next_s"] = time.monotonic() - t0
        res["step"] = "check"
        # the interrupted command left every variable as it was ...
        res["w_unchanged"] = all(np.array_equal(synk.get_value(r, w), before[r]) for r in range(n))
        # ... and collectives and calls work
        synk.all_reduce(w, op="sum")
        res["all_reduce_ok"] = all(np.all(synk.get_value(r, w) == 6.0) for r in range(n))
        res["again_result"] = float(f(np.arange(8.0)))
    res["step"] = "close"
    t0 = time.monotonic()
    synk.close()
    res["close_s"] = time.monotonic() - t0
    res["step"] = "done"
    res["left"] = tu.shm_entries(prefix)
    _result(**res)


def scenario_worker_exit(n):
    """Workers whose user code registered exit handlers and left output unflushed; then
    close(): how long it takes (the workers' exit is inside it)."""
    import pytensor.tensor as T
    import synkhronos as synk
    import _fault_scripts as fs
    fs.quiet()
    n = int(n)
    synk.fork(n)
    x = T.vector("x", dtype="float64")
    f = synk.function([x], (T.sum(fs.AtExit()(x)), "sum"))
    synk.distribute()
    total = float(f(np.arange(2.0 * n)))
    prefix = synk.session_info().resources["shm_prefix"]
    t0 = time.monotonic()
    synk.close()
    _result(total=total, close_s=time.monotonic() - t0, prefix=prefix)


def scenario_master_busy(what):
    """Print the session, then stay busy in a long call (``what="call"``: every rank sleeps
    SLEEP_S per call) or in a loop of collectives (``"collectives"``) until killed."""
    import synkhronos as synk
    import synk_testutil as tu
    f, w, info = _session(3)
    _info(prefix=info.resources["shm_prefix"], pids=list(tu.worker_pids().values()))
    data = np.full(6, TRIGGER)
    t_end = time.monotonic() + 60
    while time.monotonic() < t_end:
        if what == "call":
            f(data)
        else:
            synk.all_reduce(w, op="sum")
            synk.broadcast(w)
            synk.gather(w)


def scenario_terminate():
    """SIGTERM to the master while it waits for a slow worker: the process must exit with
    128 + 15, quietly (no traceback), and the session must be closed."""
    f, w, info = _session(3)
    _info(prefix=info.resources["shm_prefix"], pids=[r.pid for r in info.ranks if r.rank != info.master_rank])
    import threading
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    f(with_trigger(np.ones(6), 2, 3))
    _result(survived=True)               # not reached


def scenario_interrupt_compile():
    """Ctrl-C while the first call of a function compiles (a cold numba cache): the
    interrupt arrives once the compile is done, as a plain KeyboardInterrupt (an interrupt
    inside LLVM can corrupt or crash the process); the interrupted call applies nothing,
    not even with the next command; the session then works."""
    import threading
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    synk.fork(2)
    info = synk.session_info()
    _info(prefix=info.resources["shm_prefix"], pids=[r.pid for r in info.ranks if r.rank != info.master_rank])
    x = T.matrix("x", dtype="float64")
    W = T.matrix("W", dtype="float64")
    h = x
    for i in range(12):                  # a graph that takes a while to compile
        h = T.tanh(h.dot(W) * (0.1 + i)) + T.sin(h)
    w = pytensor.shared(np.zeros(3), name="w")
    u = pytensor.shared(np.zeros(3), name="u")
    f = synk.function([x], (T.sum(h), "sum"), bcast_inputs=[W], updates=[(w, w + 1.0)])
    g = synk.function([], (T.sum(u), "sum"), updates=[(u, u + 1.0)])
    synk.distribute()
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    res = {}
    t0 = time.monotonic()
    try:
        f(np.ones((4, 4)), np.eye(4))
        res["raised"] = None
    except BaseException as e:          # noqa: BLE001 - what exactly is raised is the point
        res["raised"] = type(e).__name__
    res["seconds"] = time.monotonic() - t0
    g()                                  # the next command (its first call: the master's share first)
    res["w_after"] = synk.gather(w).tolist()
    res["next"] = float(f(np.ones((4, 4)), np.eye(4)))
    res["open"] = synk.session_info().open
    synk.close()
    _result(**res)


class _Storm:
    """SIGINT to the main thread at random instants while an operation is "armed": at most
    one per armed operation (so an interrupt can never land in the bookkeeping that follows
    it), after a random delay of up to 1.5 times the typical duration of an operation (so
    that interrupts fall at every instant of one, and about half the operations complete);
    each interrupted operation lengthens the delays a little, so that half still complete
    when operations take longer than the completed ones said (a loaded machine).  ``spin``:
    the thread waits by looking between yields, not sleeps, for operations shorter than the
    machine's shortest sleep (one rank's ~80 µs calls: a 20 µs sleep took 94 µs on the
    project's VM, and the storm sent 4 SIGINTs in 170000 operations)."""

    def __init__(self, max_delay, seed, spin=False):
        import random
        import threading
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.spin = spin
        self.armed = False
        self.gen = 0
        self.sent = 0
        self.raised = 0
        self.stop = False
        self.main = threading.main_thread().ident
        signal.signal(signal.SIGINT, self._handler)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _handler(self, signum, frame):
        if self.armed:
            self.armed = False
            self.raised += 1
            raise KeyboardInterrupt

    def _pause(self, seconds):
        if not self.spin:
            time.sleep(seconds)
            return
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            os.sched_yield()             # (the GIL is released: the operation goes on)

    def _run(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        while not self.stop:
            gen = self.gen
            if not self.armed:
                self._pause(20e-6)
                continue
            self._pause(self.rng.uniform(0, self.max_delay))
            if self.armed and self.gen == gen:
                self.sent += 1
                signal.pthread_kill(self.main, signal.SIGINT)
            while self.gen == gen and not self.stop:    # one per armed operation
                self._pause(10e-6)

    def attempt(self, op):
        """(True, result) if ``op()`` completed, (False, None) if it was interrupted."""
        self.gen += 1
        t0 = time.perf_counter()
        self.armed = True
        try:
            res = op()
            self.armed = False
            self.max_delay = 0.97 * self.max_delay + 0.03 * 1.5 * (time.perf_counter() - t0)
            return True, res
        except KeyboardInterrupt:
            self.armed = False
            self.max_delay *= 1.03     # (ops slower than the typical one, e.g. under load: longer
            return False, None         # delays, or the storm would interrupt nearly every op)


_BIG = 20000     # float64 elements: above the small all-reduce's 64 KB on every rank count


def scenario_sigint_storm(target, n, seconds):
    """Calls (one with an in-graph all_reduce), training steps (plain and fp16) and
    collectives under SIGINTs at random instants until ``target`` interrupts (or
    ``seconds``).  Every completed result is checked against a model of every rank's
    state; after every interrupted operation the ranks' state must be the state before or
    after it on every rank at once (all-or-nothing), and it becomes the model."""
    import random
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos import ops
    from synkhronos.shards import split
    import _fault_scripts as fs
    fs.quiet()
    target, n, seconds = int(target), int(n), float(seconds)
    if n == 1:       # calls of ~50 us that never wait: let the storm's thread take the GIL within them
        sys.setswitchinterval(2e-5)
    synk.fork(n)
    info = synk.session_info()
    _info(prefix=info.resources["shm_prefix"], pids=[r.pid for r in info.ranks if r.rank != info.master_rank])
    x = T.vector("x", dtype="float64")
    w = pytensor.shared(np.zeros(3), name="w")
    v = pytensor.shared(np.zeros(6), name="v")
    f = synk.function([x], (T.sum(x), "sum"))
    g = synk.function([x], [(T.sum(x), "sum"), (T.sum(w), None)], updates=[(w, w + T.sum(x))])
    h = synk.function([x], [(T.max(x), "max"), (x * 2, "gather"), (T.sum(v), "sum")])
    u = pytensor.shared(np.zeros(2), name="u")      # in-graph all_reduce (no vote of its own)
    tot = ops.all_reduce(T.sum(x) * T.ones(2), "sum")
    q = synk.function([x], (tot, None), updates=[(u, u + tot)])
    from synkhronos.extensions import train, updates
    # training steps, plain and with the fp16 exchange (one rank: its own path); the gradient
    # depends on the data on one rank (elsewhere 1: a mean over ranks is not exact), so that a
    # gradient left behind shows; "big": a gradient too large for the small all-reduce (it
    # lies in the shared-memory slots), depending on every rank's data (compared to 1e-9)
    steps = {}
    for kind, dtype, size in (("step", "float64", 2), ("fp16", "float32", 2), ("big", "float64", _BIG)):
        xv = x if dtype == "float64" else T.vector("x32", dtype=dtype)
        pv = pytensor.shared(np.zeros(size, dtype), name=f"p_{kind}")
        loss = T.sum(pv) * T.sum(xv) if kind == "big" else T.sum(pv) + float(n == 1) * T.sum(xv) * pv[0]
        steps[kind] = pv, train.make_train_function(loss, [pv], [xv], updates.sgd, learning_rate=0.5,
                                                    exchange="fp16" if kind == "fp16" else None)
    synk.distribute()
    q(np.arange(6.0))
    synk.broadcast(u, np.zeros(2))
    for pv, st in steps.values():
        st(np.zeros(n, pv.dtype))
        synk.broadcast([pv, st.state_vars[0]], [np.zeros(len(pv.get_value()), pv.dtype)] * 2)
    XB = np.arange(12.0) % 5 - 2                  # rows that ``batch`` picks (one rank: its own path)
    xd = synk.data(XB)
    for num_slices in (1, 2, 3):                  # compile every variant before the storm
        f(np.arange(6.0), num_slices=num_slices)
        g(np.zeros(6), num_slices=num_slices)
        h(np.arange(6.0), num_slices=num_slices)
    rng = np.random.default_rng(0)
    pick = random.Random(1)
    model = {"w": [np.zeros(3) for _ in range(n)], "v": [np.zeros(6) for _ in range(n)],
             "u": [np.zeros(2) for _ in range(n)]}
    model.update({f"{kind}_{v}": [np.zeros(len(pv.get_value())) for _ in range(n)]
                  for kind, (pv, _) in steps.items() for v in ("p", "gs")})
    res = dict(completed=0, interrupted=0, checked=0, mismatches=[], inconsistent=[], ops={})

    def read(var):
        return [synk.get_value(r, var) for r in range(n)]

    def mismatch(what, got, want):
        if len(res["mismatches"]) < 20:
            res["mismatches"].append(f"{what}: got {got!r} want {want!r}")

    def reconcile(name, var, after):
        """After an interrupted op: every rank holds the model before, or every rank holds
        ``after`` (the model had it completed)."""
        got = read(var)
        before = model[name]
        if all(np.array_equal(a, b) for a, b in zip(got, before)):
            return
        if after is not None and all(np.array_equal(a, b) for a, b in zip(got, after)):
            model[name] = [np.array(a) for a in after]
            return
        if len(res["inconsistent"]) < 20:
            res["inconsistent"].append(f"{name}: ranks hold {[a.tolist() for a in got]}, before "
                                       f"{[a.tolist() for a in before]}, after "
                                       f"{None if after is None else [a.tolist() for a in after]}")
        model[name] = [np.array(a) for a in got]

    def settle(ok, name, var, after, what=None):
        """After an op on ``var``: completed, the model becomes ``after`` (with ``what``, every
        rank's value is checked against it); interrupted, ``reconcile``."""
        if not ok:
            reconcile(name, var, after)
            return
        model[name] = after
        if what is not None:
            got = read(var)
            if not all(np.array_equal(a, c) for a, c in zip(got, after)):
                mismatch(what, got, after)

    storm = _Storm(max_delay=0.0003, seed=2, spin=n == 1)
    jax_ranks = (os.environ.get("SYNK_MODE") or "").strip().upper() == "JAX"
    t_end = time.monotonic() + seconds
    while storm.raised < target and time.monotonic() < t_end:
        op = pick.choice(["f", "g", "g_batch", "h", "all_reduce", "broadcast", "scatter", "gather", "set_get",
                          "ingraph", "step", "fp16", "big"])
        res["ops"][op] = res["ops"].get(op, 0) + 1
        k = int(rng.integers(0, 13))
        xs = rng.integers(-5, 6, k).astype(np.float64)
        b = split(k, n)
        if op == "f":
            ok, out = storm.attempt(lambda: f(xs))
            if ok and out != xs.sum():
                mismatch("f", out, xs.sum())
        elif op == "g":
            after = [model["w"][r] + xs[b[r]:b[r + 1]].sum() if b[r + 1] > b[r] else model["w"][r]
                     for r in range(n)]
            ok, out = storm.attempt(lambda: g(xs))
            if ok and out[0] != xs.sum():
                mismatch("g sum", out[0], xs.sum())
            settle(ok, "w", w, after, "g update")
        elif op == "g_batch":                     # a list of rows (repeats allowed) or a slice
            if pick.random() < 0.6:
                sel = [pick.randrange(12) for _ in range(pick.randint(1, 7))]
            else:
                lo = pick.randrange(12)
                sel = slice(lo, pick.randint(lo + 1, 12))
            rows = XB[sel]
            bb = split(len(rows), n)
            after = [model["w"][r] + rows[bb[r]:bb[r + 1]].sum() if bb[r + 1] > bb[r] else model["w"][r]
                     for r in range(n)]
            ok, out = storm.attempt(lambda: g(xd, batch=sel))
            if ok and out[0] != rows.sum():
                mismatch("g batch sum", out[0], rows.sum())
            settle(ok, "w", w, after, "g batch update")
        elif op == "h":
            if k == 0 and jax_ranks:      # an empty max raises on JAX, in plain PyTensor JAX too
                xs = rng.integers(-5, 6, 1).astype(np.float64)
                k, b = 1, split(1, n)
            ok, out = storm.attempt(lambda: h(xs, num_slices=3))
            if ok:     # sum(v) is computed once per slice (at most 3 per rank) and summed
                want_sum = sum(model["v"][r].sum() * min(3, b[r + 1] - b[r]) for r in range(n))
                if k and (out[0] != xs.max() or not np.array_equal(out[1], xs * 2) or out[2] != want_sum):
                    mismatch("h", out, (xs.max(), xs * 2, want_sum))
        elif op == "ingraph":                     # every rank needs a row: n + k rows
            xs = rng.integers(-5, 6, n + k).astype(np.float64)
            after = [m + xs.sum() for m in model["u"]]
            ok, out = storm.attempt(lambda: q(xs))
            if ok and not np.array_equal(out, [xs.sum()] * 2):
                mismatch("ingraph", out, xs.sum())
            settle(ok, "u", u, after, "ingraph update")
        elif op in steps:                         # every rank needs a row: n + k rows
            pv, st = steps[op]
            xs = rng.integers(-5, 6, n + k).astype(pv.dtype)
            kp, kg = f"{op}_p", f"{op}_gs"
            if op == "big":       # each rank's gradient: the sum of its rows; ranks weigh by rows
                bb = split(n + k, n)
                mean = sum((bb[r + 1] - bb[r]) * xs[bb[r]:bb[r + 1]].sum() for r in range(n)) / (n + k)
                loss = model[kp][0].sum() * mean
                gs = [np.full(_BIG, mean)] * n
            else:
                loss = model[kp][0].sum() + (n == 1) * xs.sum() * model[kp][0][0]
                gs = [np.array([1.0 + (n == 1) * xs.sum(), 1.0])] * n
            after = {kp: [m - 0.5 * g for m, g in zip(model[kp], gs)], kg: gs}
            ok, out = storm.attempt(lambda: st(xs))
            if ok and abs(out - loss) > 1e-6 * max(1.0, abs(loss)):      # (float32: the loss rounds)
                mismatch(f"{op} loss", out, loss)
            got = {kp: read(pv), kg: read(st.state_vars[0])}
            # (uneven shards weigh each rank's gradient by its rows: a scaling that rounds,
            # in float16 on the fp16 exchange's wire; a step moves the parameters by ~0.5)
            tol = 2e-3 if op == "fp16" else 1e-9
            same = lambda a, b: np.allclose(a, b, rtol=0, atol=tol)     # noqa: E731

            def holds(state):
                return all(same(a, b) for k in state for a, b in zip(got[k], state[k]))
            if ok and not holds(after):
                mismatch(f"{op} update", got, after)
            elif not ok and not holds(after) and not holds({k: model[k] for k in after}) \
                    and len(res["inconsistent"]) < 20:
                res["inconsistent"].append(f"{op} interrupted: ranks hold {got}, before "
                                           f"{ {k: model[k] for k in after} }, after {after}")
            model.update(got)
        elif op == "all_reduce":
            after = [sum(model["v"])] * n
            ok, _ = storm.attempt(lambda: synk.all_reduce(v, op="sum"))
            settle(ok, "v", v, after)
        elif op == "broadcast":
            val = rng.integers(-9, 10, 6).astype(np.float64)
            ok, _ = storm.attempt(lambda: synk.broadcast(v, val))
            settle(ok, "v", v, [val] * n)
        elif op == "scatter":
            val = rng.integers(-9, 10, 6 * n).astype(np.float64)
            after = [val[6 * r:6 * r + 6] for r in range(n)]
            ok, _ = storm.attempt(lambda: synk.scatter(v, val))
            settle(ok, "v", v, after)
        elif op == "gather":
            ok, out = storm.attempt(lambda: synk.gather(v))
            if ok and not np.array_equal(out, np.stack(model["v"])):
                mismatch("gather", out, model["v"])
        else:
            r = int(rng.integers(0, n))
            val = rng.integers(-9, 10, 3).astype(np.float64)
            ok, _ = storm.attempt(lambda: synk.set_value(r, w, val))
            after = [val if q == r else model["w"][q] for q in range(n)]
            if ok:
                model["w"] = after
                ok2, got = storm.attempt(lambda: synk.get_value(r, w))
                if ok2 and not np.array_equal(got, val):
                    mismatch("get_value", got, val)
            else:
                reconcile("w", w, after)
        res["completed" if ok else "interrupted"] += 1
        res["checked"] += 1
    storm.stop = True
    storm.thread.join()
    res["interrupts"] = storm.raised
    res["typical_op_us"] = storm.max_delay / 1.5 * 1e6
    res["sigints_sent"] = storm.sent
    finals = [("w", w), ("v", v), ("u", u)] + [(f"{kind}_{v}", var) for kind, (pv, st) in steps.items()
                                               for v, var in (("p", pv), ("gs", st.state_vars[0]))]
    for name, var in finals:                      # the end state agrees with the model
        got = read(var)
        if not all(np.array_equal(a, c) for a, c in zip(got, model[name])):
            mismatch(f"final {name}", got, model[name])
    res["final_f"] = float(f(np.arange(10.0)))
    synk.close()
    res["left"] = [e for e in os.listdir("/dev/shm") if e.startswith(info.resources["shm_prefix"].lstrip("/"))]
    _result(**res)


def scenario_close_storm(sessions):
    """``sessions`` sessions, each closed (``synk.close()``, again after each interrupt)
    under SIGINTs every 0.05-2 ms: each must end with its workers gone and nothing of it in
    /dev/shm.  (A Ctrl-C half way through a close once left a session's segments for good,
    ~1 in 30: its memory given back before its names went, the master's pid with it.)"""
    import random
    import threading
    import pytensor
    import synkhronos as synk
    pick = random.Random(7)
    res = {"closed": 0, "interrupts": 0, "ignored": 0, "left": {}, "alive": {}}
    armed = []

    def gate(signum, frame):
        """Raise only inside the close below, once per try: an interrupt landing in this
        script's own bookkeeping (a thread start, a loop jump) is not what is tested."""
        if armed:
            armed.clear()
            raise KeyboardInterrupt
        res["ignored"] += 1
    signal.signal(signal.SIGINT, gate)      # synkhronos defers and then calls this handler
    for k in range(int(sessions)):
        synk.fork(2)
        info = synk.session_info()
        prefix, pids = info.resources["shm_prefix"].lstrip("/"), [r.pid for r in info.ranks if r.rank]
        v = pytensor.shared(np.zeros(1 << 19, "float32"), name="v")
        synk.function([], v.sum())
        synk.distribute()
        synk.all_reduce(v, "sum")
        stop = []

        def storm():
            while not stop:
                time.sleep(pick.uniform(5e-5, 2e-3))
                os.kill(os.getpid(), signal.SIGINT)
        t = threading.Thread(target=storm, daemon=True)
        t.start()
        while synk.session_info() is not None:
            try:
                try:
                    armed.append(1)
                    synk.close()
                finally:
                    armed.clear()
            except KeyboardInterrupt:
                res["interrupts"] += 1
        stop.append(1)
        t.join()
        res["closed"] += 1
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
            time.sleep(0.05)
        left = [e for e in os.listdir("/dev/shm") if e.startswith(prefix) or e.startswith("sem." + prefix)]
        if left:
            res["left"][prefix] = left
        alive = [p for p in pids if os.path.exists(f"/proc/{p}")]
        if alive:
            res["alive"][prefix] = alive
    _result(**res)


def scenario_fork_storm(sessions):
    """``sessions`` times ``synk.fork(3)`` with 1-3 SIGINTs at a random instant of it (the
    workers forked by the fork server, its first start included): each fork ends started or
    interrupted, leaving nothing of it in /dev/shm.  The instants fall within twice the
    length of the last fork that ended (a fast machine forks in 30 ms); the second fork is
    interrupted at its start and the last one is left alone, so that both outcomes occur;
    after each, ``close()`` leaves no worker of it running.  Reports the fork server(s) this
    process has, for the test to see them end with it."""
    import random
    import tempfile
    import threading
    import synkhronos as synk
    import synk_testutil as tu
    pick = random.Random(11)
    res = {"started": 0, "interrupted": 0, "alive": [], "left": [], "servers": []}
    # this program's sessions (each prefix is logged as it is made; others are not looked at)
    log = os.environ.get("SYNK_PREFIX_LOG") or os.path.join(tempfile.mkdtemp(), "prefixes")
    os.environ["SYNK_PREFIX_LOG"] = log
    start = os.path.getsize(log) if os.path.exists(log) else 0

    def mine():
        with open(log) as fh:
            fh.seek(start)
            return tuple(p.strip().lstrip("/") + "_" for p in fh if p.strip())
    armed = []

    def gate(signum, frame):
        if armed:
            armed.clear()
            raise KeyboardInterrupt
    signal.signal(signal.SIGINT, gate)
    took = 1.5                  # the last fork's length (the first starts the fork server: ~1.5 s)
    for k in range(int(sessions)):
        stop = []
        wait = 0.0 if k == 1 else 5 * took if k == int(sessions) - 1 else pick.uniform(0.0, 2 * took)

        def storm():
            time.sleep(wait)
            for _ in range(pick.randint(1, 3)):
                if stop:
                    return
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(pick.uniform(5e-5, 3e-3))
        t = threading.Thread(target=storm, daemon=True)
        t.start()
        try:
            try:
                armed.append(1)
                t0 = time.monotonic()
                synk.fork(3)
                took = time.monotonic() - t0
            finally:
                armed.clear()
            res["started"] += 1
        except KeyboardInterrupt:
            res["interrupted"] += 1
        stop.append(1)
        t.join()
        synk.close()
        if not tu.wait_until(lambda: not tu.worker_children(), 5.0):
            res["alive"].append(tu.worker_children())
        bases = mine()
        left = [e for e in os.listdir("/dev/shm") if e.startswith(bases + tuple("sem." + b for b in bases))]
        if left:
            res["left"].append(left)
    res["servers"] = tu.fork_servers()
    _result(**res)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    name, args = sys.argv[1], sys.argv[2:]
    {"ctrl_c": scenario_ctrl_c, "master_busy": scenario_master_busy,
     "sigint_storm": scenario_sigint_storm, "terminate": scenario_terminate,
     "interrupt_compile": scenario_interrupt_compile, "close_storm": scenario_close_storm,
     "fork_storm": scenario_fork_storm,
     "worker_exit": scenario_worker_exit}[name](*args)
