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
import json, os, time
_spec = os.environ.get("SYNK_TEST_STARTUP_FAULT")
if _spec:
    try:
        with open("/proc/self/cmdline", "rb") as _fh:
            _argv = _fh.read().split(b"\\0")
        _rank = json.loads(_argv[_argv.index(b"synkhronos.worker") + 1])["rank"]
    except Exception:
        _rank = None
    for _one in _spec.split(","):
        _parts = _one.split(":")
        if _rank is None or _rank != int(_parts[1]):
            continue
        if _parts[0] == "kill":
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        elif _parts[0] == "raise":
            os.environ["PYTENSOR_FLAGS"] = "floatX=synk_fault_injected"
        elif _parts[0] == "sleep":
            time.sleep(float(_parts[2]))
'''


def startup_fault_env(tmp_path, spec):
    """{env var: value} that makes the workers named in ``spec`` fail at start-up."""
    d = tmp_path / "synk_sitecustomize"
    d.mkdir(exist_ok=True)
    (d / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(d) + (os.pathsep + old if old else ""),
            "SYNK_TEST_STARTUP_FAULT": spec}


# ------------------------------------------------------------------------------------------
# Master programs (run as ``python _fault_scripts.py SCENARIO``)


def _info(**kw):
    print("SYNK-INFO " + json.dumps(kw), flush=True)


def _result(**kw):
    print("SYNK-RESULT " + json.dumps(kw), flush=True)


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
    _watchdog(res, SLEEP_S + 1.5)
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


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    name, args = sys.argv[1], sys.argv[2:]
    {"ctrl_c": scenario_ctrl_c, "master_busy": scenario_master_busy}[name](*args)
