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
from synkhronos import session  # noqa: E402

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
