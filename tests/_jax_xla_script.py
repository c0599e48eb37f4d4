"""Scenarios of XLA's multi-process collectives (gloo on the CPU), each run as its own
master process by tests/test_jax_xla_comm.py: ``jax.distributed`` must be set up before
any JAX use in the master, which a pytest process that ran other JAX tests cannot offer.

    python tests/_jax_xla_script.py SCENARIO [N]      (SYNK_XLA_TEST_GPU=1: on GPUs, one per rank)

Prints ``RESULT <json>`` lines; exits 0 when the scenario's checks passed."""
import json
import os
import signal
import sys
import threading
import time

os.environ["SYNK_JAX_COMM"] = "xla"

import numpy as np  # noqa: E402
import pytensor  # noqa: E402
import pytensor.tensor as T  # noqa: E402

import synkhronos as synk  # noqa: E402
from synkhronos import ops, session  # noqa: E402

DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint32"]
OPS = ["avg", "sum", "prod", "max", "min"]


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def expected(op, parts, dt):
    stack = np.stack(parts)
    if op == "avg":
        mean = stack.astype(np.float64).mean(axis=0)
        return (np.rint(mean) if dt.kind in "iu" else mean).astype(dt)
    if op == "sum":
        return (stack.astype(np.float64).sum(0).astype(dt) if dt.kind == "f"
                else np.add.reduce(stack, axis=0, dtype=dt))
    if op == "prod":
        return (stack.astype(np.float64).prod(0).astype(dt) if dt.kind == "f"
                else np.multiply.reduce(stack, axis=0, dtype=dt))
    return stack.max(0) if op == "max" else stack.min(0)


def values(dt, n, shape, rng):
    if dt.kind == "f":
        return [rng.uniform(-2, 2, shape).astype(dt) for _ in range(n)]
    lo, hi = (0, 4) if dt.kind == "u" else (-3, 4)
    return [rng.integers(lo, hi, shape).astype(dt) for _ in range(n)]


USE_GPU = os.environ.get("SYNK_XLA_TEST_GPU") == "1"      # GPU ranks (NCCL); default: CPU ranks (gloo)


def build(n):
    synk.fork(n, mode="JAX", use_gpu=USE_GPU)
    shareds = {dt: pytensor.shared(np.zeros((3, 2), dt), name=f"s_{dt}") for dt in DTYPES}
    w = pytensor.shared(np.ones(4, "float64"), name="w")
    x = T.matrix("x", dtype="float64")
    f = synk.function([x], (x.dot(w)).sum(), updates=[(w, w + x.sum(0))])
    g = synk.function([], sum(s.sum().astype("float64") for s in shareds.values()))
    synk.distribute()
    return shareds, w, f, g


def comm_name(verb, dtype, op=None):
    me = session.get_session().me
    return me.comm.pick(verb, dtype, op, me.device.placement).name


def scenario_values(n):
    import jax
    shareds, w, f, g = build(n)
    rng = np.random.default_rng(0)
    picked = {}
    checked = 0
    for dt_name, var in shareds.items():
        dt = np.dtype(dt_name)
        for op in OPS:
            parts = values(dt, n, (3, 2), rng)
            for r, p in enumerate(parts):
                synk.set_value(r, var, p)
            synk.all_reduce(var, op)
            picked[f"all_reduce {dt_name} {op}"] = comm_name("all_reduce", dt_name, op)
            got = synk.gather(var)
            want = expected(op, parts, dt)
            for r in range(n):
                assert got[r].dtype == dt, (dt_name, op, got[r].dtype)
                if dt.kind == "f":
                    tol = 2e-2 if dt_name == "float16" else 1e-5
                    np.testing.assert_allclose(got[r].astype(np.float64), want.astype(np.float64),
                                               rtol=tol, atol=tol, err_msg=f"{dt_name} {op}")
                else:
                    np.testing.assert_array_equal(got[r], want, err_msg=f"{dt_name} {op}")
            assert isinstance(var.container.storage[0], jax.Array)
            checked += 1
    # broadcast: exact bits (negative zero, NaN, infinities survive)
    b = shareds["float32"]
    special = np.array([[-0.0, np.nan], [np.inf, -np.inf], [1.5, -2.25]], np.float32)
    synk.set_value(0, b, special)
    synk.broadcast(b)
    picked["broadcast float32"] = comm_name("broadcast", "float32")
    for part in synk.gather(b):
        assert part.tobytes() == special.tobytes(), part
    # all_gather of unequal lengths, rank order
    v = shareds["int32"]
    parts = [np.full((r + 1, 2), r, np.int32) for r in range(n)]
    for r, p in enumerate(parts):
        synk.set_value(r, v, p)
    synk.all_gather(v)
    picked["all_gather int32"] = comm_name("all_gatherv", "int32")
    for part in synk.gather(v, nd_up=1):
        np.testing.assert_array_equal(part, np.concatenate(parts))
    assert isinstance(v.container.storage[0], jax.Array)
    # unequal shapes: ValueError on every rank, values unchanged
    a = shareds["float64"]
    synk.set_value(0, a, np.ones((3, 2)))
    for r in range(1, n):
        synk.set_value(r, a, np.ones((2, 2)))
    try:
        synk.all_reduce(a, "sum")
        raise AssertionError("unequal shapes were accepted")
    except (ValueError, synk.WorkerError) as e:
        assert "same shape" in str(e), e
    shapes = synk.get_shapes(a)
    assert shapes[0] == (3, 2) and all(s == (2, 2) for s in shapes[1:]), shapes
    # verbs XLA does not serve go through the host, and functions still run
    for r in range(n):
        synk.set_value(r, a, np.ones((3, 2)))
    synk.reduce(a, "sum")
    picked["reduce float64"] = comm_name("reduce", "float64", "sum")
    picked["all_reduce bool"] = comm_name("all_reduce", "bool", "sum")
    f(np.ones((2 * n, 4)))
    synk.all_reduce(w, "avg")
    assert isinstance(w.container.storage[0], jax.Array)
    g()                                            # (holds the NaN broadcast above)
    synk.close()
    result(checked=checked, picked=picked)


def scenario_kill_in_collective(n):
    """A worker dies while the master is inside an XLA all_reduce."""
    from synkhronos.backends.jax import xla_comm
    shareds, w, f, g = build(n)
    synk.all_reduce(w, "sum")                  # connections established
    victim = [r.pid for r in synk.session_info().ranks if r.rank == 1][0]
    orig = xla_comm.XlaComm._run

    def late_run(self, key, body, args):       # the worker enters first; it dies meanwhile
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.5)
        return orig(self, key, body, args)
    xla_comm.XlaComm._run = late_run
    t = time.perf_counter()
    try:
        synk.all_reduce(w, "sum")
        raise AssertionError("no error")
    except synk.WorkerDied as e:
        took = time.perf_counter() - t
        result(error=type(e).__name__, message=str(e), seconds=took)
    xla_comm.XlaComm._run = orig
    assert synk.session_info() is None


def scenario_kill_idle(n):
    """A worker dies between commands and stays dead past JAX's heartbeat timeout: the
    master must not be aborted by JAX; the next command raises WorkerDied."""
    hb = float(os.environ["SYNK_JAX_HEARTBEAT"])
    shareds, w, f, g = build(n)
    synk.all_reduce(w, "sum")
    victim = [r.pid for r in synk.session_info().ranks if r.rank == n - 1][0]
    os.kill(victim, signal.SIGKILL)
    time.sleep(hb + 3)
    t = time.perf_counter()
    try:
        synk.all_reduce(w, "sum")
        raise AssertionError("no error")
    except synk.WorkerDied as e:
        result(error=type(e).__name__, message=str(e), seconds=time.perf_counter() - t)


def _in_graph_session(n, path):
    """test_ops' cases (every in-graph collective, values and gradients) in a session over
    XLA's collectives, with a timeline at ``path``."""
    import types
    import test_ops as to                      # (tests/ is this script's folder)
    synk.fork(n, mode="JAX", timeline=path)
    rng = np.random.default_rng(7)
    v = to.symbols()
    v.w = pytensor.shared(rng.uniform(0.5, 1.5, to.D), name="w")
    fs = {name: to.build(v, name) for name in to.CASES}
    h = T.matrix("h", dtype="float16")       # float16 inside a program (XLA's collectives take it)
    fs["float16"] = synk.function([h], [(ops.all_reduce(h, "sum"), "gather"), (ops.all_gather(h), "gather"),
                                        (ops.broadcast(h, n - 1), "gather")], name="float16")
    synk.distribute()
    S = types.SimpleNamespace(n=n, v=v, fs=fs, serial={}, data=dict(
        X=rng.standard_normal((to.N, to.D)), c=rng.standard_normal(to.D), A=rng.standard_normal((to.M, to.D)),
        C=rng.standard_normal((to.N, to.D)), cnt=np.asarray(to.COUNTS[n], np.int64)))
    return to, S


def _programs_by_function(path, n):
    """{rank: {function name: calls that ran as one XLA program}} from a timeline."""
    events = json.loads(open(path).read())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    out = {}
    for r in range(n):
        calls = [e for e in spans if e["pid"] == r and e["name"].startswith("call of function ")]
        progs = [e for e in spans if e["pid"] == r and e["name"] == "in-graph program"]
        assert all(e["args"]["via"] == "xla" for e in progs), progs
        got = out.setdefault(r, {})
        for p in progs:
            call = next(c for c in calls if c["ts"] <= p["ts"] <= c["ts"] + c["dur"])
            name = call["name"][len("call of function "):]
            got[name] = got.get(name, 0) + 1
    return out


def scenario_in_graph(n):
    """Every case of test_ops on even shards (one XLA program: the collectives inside it)
    and on uneven ones (jitted stretches), against the serial graph."""
    path = os.path.join(os.environ.get("SYNK_TEST_TMP", "/tmp"), f"synk_in_graph_{os.getpid()}.json")
    to, S = _in_graph_session(n, path)
    rows = 2 * n * 3                           # even shards, and reduce_scatter's even blocks
    rng = np.random.default_rng(1)
    even = dict(X=rng.standard_normal((rows, to.D)), C=rng.standard_normal((rows, to.D)),
                A=rng.standard_normal((rows, to.D)), cnt=np.full(n, rows // n, np.int64))
    one = dict(X=rng.standard_normal((n, to.D)), C=rng.standard_normal((n, to.D)),
               A=rng.standard_normal((n, to.D)), cnt=np.ones(n, np.int64))
    H = rng.integers(-100, 101, (2 * n, 3)).astype("float16")      # (sums exact in any order)
    try:
        for name in to.CASES:
            to.compare(S, name, data=even)     # one program where it can
            to.compare(S, name)                # uneven shards (7 rows): stretches
            if n == 2:
                to.compare(S, name, data=one)  # one row a rank: one program too
        total, gathered, bcast = S.fs["float16"](H)
        blocks = [H[2 * r:2 * r + 2] for r in range(n)]
        want = sum(b.astype(np.float32) for b in blocks).astype(np.float16)
        assert total.dtype == np.float16 and np.array_equal(total, np.concatenate([want] * n)), total
        assert np.array_equal(gathered, np.concatenate([H] * n)), gathered
        assert np.array_equal(bcast, np.concatenate([blocks[-1]] * n)), bcast
    finally:
        synk.close()
    try:
        progs = _programs_by_function(path, n)
    finally:
        os.unlink(path)
    result(programs={str(r): p for r, p in progs.items()})


def _fault_in_program(n, sig, error):
    """The last rank gets ``sig`` while the master runs an in-graph collective's XLA program
    (the worker entered it first): ``error`` ends the call, the session is closed."""
    from synkhronos.backends.jax import xla_comm
    path = os.path.join(os.environ.get("SYNK_TEST_TMP", "/tmp"), f"synk_in_graph_{os.getpid()}.json")
    to, S = _in_graph_session(n, path)
    even = dict(X=np.ones((2 * n, to.D)), C=np.ones((2 * n, to.D)))
    to.compare(S, "all_reduce_sum", data=even)          # compiled and connected
    victim = [r.pid for r in synk.session_info().ranks if r.rank == n - 1][0]
    orig = xla_comm.XlaComm.execute

    def late(self, program, args):
        os.kill(victim, sig)
        time.sleep(0.5)
        return orig(self, program, args)
    xla_comm.XlaComm.execute = late
    t = time.perf_counter()
    try:
        to.compare(S, "all_reduce_sum", data=even)
        raise AssertionError("no error")
    except error as e:
        result(error=type(e).__name__, message=str(e), seconds=time.perf_counter() - t, victim=victim)
    finally:
        xla_comm.XlaComm.execute = orig
        if os.path.exists(path):
            os.unlink(path)
    assert synk.session_info() is None


def scenario_kill_in_program(n):
    """A worker dies while the master runs an in-graph collective's XLA program."""
    _fault_in_program(n, signal.SIGKILL, synk.WorkerDied)


def scenario_stop_in_program(n):
    """A worker freezes (SIGSTOP) inside an in-graph collective's XLA program: on CPU ranks
    XLA runs it inside the dispatch, which the master therefore leaves to a thread."""
    _fault_in_program(n, signal.SIGSTOP, synk.WorkerStopped)


def scenario_program_storm(n):
    """Ctrl-C at random instants (every 0.5-20 ms, for STORM_S seconds) while a training
    step whose gradient holds an in-graph all_reduce runs as one XLA program: each call
    ends done or interrupted, never hung; the ranks' values stay equal (all or nothing)."""
    import random
    from synkhronos import ops
    synk.fork(n, mode="JAX")
    x = T.matrix("x")
    w = pytensor.shared(np.ones(64), name="w")
    h = ops.all_reduce(T.tanh(x * w).sum(axis=0), "sum")
    f = synk.function([x], (h.sum(), None), updates=[(w, w + 0.001 * h)])
    synk.distribute()
    E = np.ones((2 * n, 64))
    f(E)
    stop = threading.Event()

    def storm():
        while not stop.is_set():
            time.sleep(random.uniform(0.0005, 0.02))
            os.kill(os.getpid(), signal.SIGINT)
    outcomes = {"done": 0, "interrupted": 0, "outside": 0}
    in_call = [False]

    def on_sigint(signum, frame):          # (synkhronos defers it, then calls it)
        if in_call[0]:
            raise KeyboardInterrupt
        outcomes["outside"] += 1           # the script's own code between calls is left alone
    signal.signal(signal.SIGINT, on_sigint)
    t = threading.Thread(target=storm, daemon=True)
    t.start()
    end = time.monotonic() + float(os.environ.get("STORM_S", 10))
    while time.monotonic() < end:
        try:
            try:
                in_call[0] = True
                f(E)
                in_call[0] = False
                outcomes["done"] += 1
            except KeyboardInterrupt:
                in_call[0] = False
                outcomes["interrupted"] += 1
        except KeyboardInterrupt:          # (a second interrupt within a few bytecodes)
            in_call[0] = False
    stop.set()
    t.join()
    values = [synk.get_value(r, w) for r in range(n)]
    f(E)                                    # the session goes on
    prefix = synk.session_info().resources["shm_prefix"]
    synk.close()
    result(outcomes=outcomes, equal=all(np.array_equal(values[0], v) for v in values), prefix=prefix)


def scenario_master_killed(n):
    """Prints the workers' pids, then waits to be killed."""
    _, w, _, _ = build(n)
    synk.all_reduce(w, "sum")
    result(workers=[r.pid for r in synk.session_info().ranks if r.rank != 0],
           prefix=synk.session_info().resources["shm_prefix"])
    threading.Event().wait(120)


if __name__ == "__main__":
    name = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    globals()["scenario_" + name](n)
    print("DONE", flush=True)
