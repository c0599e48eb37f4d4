"""Master programs for the tests of the master's own faults (``test_faults_master.py``):
``python _fault_scripts.py SCENARIO ARGS`` runs ``scenario_SCENARIO`` (the SIGINT storms
among them live in ``_sigint_storms.py``).  They print one line ``SYNK-INFO {json}`` when
the session is up and one line ``SYNK-RESULT {json}`` at the end: ``_info`` and ``_result``,
the emitter of every test script (the MPI ones too)."""
import json
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fault_ops import SLEEP_S, TRIGGER, AtExit, Fault, quiet, with_trigger  # noqa: E402


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
    quiet()
    synk.fork(n)
    x = T.vector("x", dtype="float64")
    w = pytensor.shared(np.zeros(1000), name="w")
    g = synk.function([x], [(T.sum(Fault("sleep")(x)), "sum"), (T.sum(w), None)])
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
    quiet()
    n = int(n)
    synk.fork(n)
    x = T.vector("x", dtype="float64")
    f = synk.function([x], (T.sum(AtExit()(x)), "sum"))
    synk.distribute()
    total = float(f(np.arange(2.0 * n)))
    prefix = synk.session_info().resources["shm_prefix"]
    t0 = time.monotonic()
    synk.close()
    _result(total=total, close_s=time.monotonic() - t0, prefix=prefix)


def scenario_master_busy(what, n="3"):
    """Print the session (of ``n`` ranks), then stay busy in a long call (``what="call"``:
    every rank sleeps SLEEP_S per call) or in a loop of collectives (``"collectives"``)
    until killed."""
    import synkhronos as synk
    import synk_testutil as tu
    f, w, info = _session(int(n))
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


if __name__ == "__main__":
    import _sigint_storms as storms
    name, args = sys.argv[1], sys.argv[2:]
    {"ctrl_c": scenario_ctrl_c, "master_busy": scenario_master_busy,
     "sigint_storm": storms.scenario_sigint_storm, "terminate": scenario_terminate,
     "interrupt_compile": scenario_interrupt_compile, "close_storm": storms.scenario_close_storm,
     "fork_storm": storms.scenario_fork_storm,
     "worker_exit": scenario_worker_exit}[name](*args)
