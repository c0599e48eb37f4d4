"""Programs bench_mpi.py runs on the simulated hosts: ``python _mpi_bench_prog.py MODE SPEC``
(SPEC: JSON), under ``mpiexec`` or alone.  Every result is one JSON line ``BENCH {...}`` on
stdout and, when ``SYNK_RESULT_FILE`` is set, appended to that file (the parent follows it
to show progress: the output of several hosts can interleave on stdout).

Modes:

* ``synk_allreduce``: ``synk.fork(n)``; one float32 shared variable per size, all registered
  by one function (called only after the timed calls, to check the values); per size:
  ``synk.broadcast`` a value, then time
  ``synk.all_reduce(var, "sum")`` in the master (call to return: every rank of every host
  done) ``warmup + reps`` times.  The variable's storage stays the collective's result
  between repetitions (as in training: nothing is re-set), so the value is multiplied by n
  every time; it starts at 2**-60 and the number of repetitions is capped so that it stays
  finite, and the final value (exact: powers of two) is checked on every rank (first and
  last element, min and max over the ranks, by the registering function) with the shape.
* ``mpi_allreduce``: mpi4py ``comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`` on a float32
  buffer, ``Barrier`` before each repetition, the time of a repetition is the slowest
  rank's (``allreduce(MAX)`` of the ranks' times, not timed); same values and checks.  With
  ``"pin": true`` the first rank of each host pins itself to a core of its own (core i for
  host i).  With ``"driven": true``, what a master-driven program needs at the least (the
  model synkhronos follows: one process decides, the others act on its word): rank 0 sends
  the command (``Bcast`` of 16 bytes: the others wait for it inside MPI), every rank runs the
  ``Allreduce``, then rank 0 hears that every rank is done (``Gather`` of one byte); the time
  is rank 0's, from the command to the last "done".
* ``overhead``: ``synk.fork(n)``; ``f = synk.function([x], (T.sum(x), "sum"))`` called on an
  8-element float32 ``synk.data``, against ``pytensor.function([x], T.sum(x))`` on the same
  numpy array, alternating blocks; median per-call time of the blocks.

The synkhronos modes print ``ready`` once the session is up and, when ``spec["go"]`` names a
file, wait for it before measuring: the parent pins the MPI processes meanwhile.
"""
import json
import os
import sys
import time

import numpy as np

V0 = 2.0 ** -60          # start value of the all_reduce buffers (exact powers of two)


def emit(kind, **kw):
    line = "BENCH " + json.dumps(dict(kind=kind, **kw))
    print(line, flush=True)
    path = os.environ.get("SYNK_RESULT_FILE")
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")


def expected(n, calls):
    return V0 * float(n) ** calls


def wait_go(spec):
    """With ``spec["go"]`` (a path): wait until the parent created it (it pins the MPI
    processes to cores first, once the session is up; see bench_mpi.py)."""
    path = spec.get("go")
    if not path:
        return
    end = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no go from the parent ({path})")
        time.sleep(0.01)


def synk_allreduce(spec):
    import pytensor
    import synkhronos as synk
    t0 = time.perf_counter()
    n = synk.fork(spec.get("n"))
    info = synk.session_info()
    emit("session", n=n, ranks=[(r.rank, r.host) for r in info.ranks],
         fork_s=time.perf_counter() - t0)
    sizes, reps, warmup = spec["sizes"], spec["reps"], spec["warmup"]
    vs = [pytensor.shared(np.zeros(1, np.float32), name=f"v{s}") for s in sizes]
    # registers the variables; called only to check the values: the smallest and largest of
    # each variable's first and last element over every rank of every host
    ends = [v[[0, -1]] for v in vs]
    check = synk.function([], outputs=[o for e in ends for o in ((e.min(), "min"), (e.max(), "max"))])
    synk.distribute()
    emit("ready")
    wait_go(spec)
    for size, r, v in zip(sizes, reps, vs):
        count = size // 4
        t = time.perf_counter()
        synk.broadcast(v, np.full(count, V0, np.float32))
        setup_s = time.perf_counter() - t
        ts = []
        for i in range(warmup + r):
            t = time.perf_counter()
            synk.all_reduce(v, op="sum")
            dt = time.perf_counter() - t
            if i >= warmup:
                ts.append(dt)
        want = expected(n, warmup + r)
        t = time.perf_counter()
        i = vs.index(v)
        out = check()
        got = [float(out[2 * i]), float(out[2 * i + 1])]          # min, max over all ranks
        shapes = synk.get_shapes(v)
        ok = bool(all(g == want for g in got) and all(sh == (count,) for sh in shapes))
        check_s = time.perf_counter() - t
        emit("allreduce", impl="synk", size=size, times=ts, ok=ok,
             check=dict(want=want, got=got), setup_s=setup_s, check_s=check_s)
        synk.broadcast(v, np.zeros(1, np.float32))         # give the memory back (best effort)
    synk.close()


def mpi_allreduce(spec):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    ppn = spec.get("ppn", 1)
    if spec.get("pin") and comm.rank % ppn == 0:
        # the first rank of each host (its leader in MPICH's node-aware collectives) on a
        # core of its own, as the master and the agents of the synkhronos runs are
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[(comm.rank // ppn) % len(cpus)]})
    if comm.rank == 0:
        emit("session", n=n, ranks=comm.gather((comm.rank, MPI.Get_processor_name())))
    else:
        comm.gather((comm.rank, MPI.Get_processor_name()))
    sizes, reps, warmup = spec["sizes"], spec["reps"], spec["warmup"]
    driven = bool(spec.get("driven"))
    for size, r in zip(sizes, reps):
        buf = np.full(size // 4, V0, np.float32)
        cmd, done, dones = np.zeros(2, np.int64), np.ones(1, np.uint8), np.zeros(n, np.uint8)
        ts = []
        for i in range(warmup + r):
            comm.Barrier()
            t = time.perf_counter()
            if driven:
                cmd[:] = (1, size)
                comm.Bcast(cmd, root=0)
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                comm.Gather(done, dones, root=0)
                dt = comm.bcast(time.perf_counter() - t, root=0)
            else:
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                dt = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
            if i >= warmup:
                ts.append(dt)
        want = expected(n, warmup + r)
        ok = comm.allreduce(bool(buf[0] == want and buf[-1] == want), op=MPI.LAND)
        if comm.rank == 0:
            emit("allreduce", impl="mpi4py_driven" if driven else "mpi4py", size=size, times=ts, ok=bool(ok),
                 check=dict(want=want, got=[float(buf[0]), float(buf[-1])]))
        del buf


def overhead(spec):
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    n = synk.fork(spec.get("n"))
    info = synk.session_info()
    emit("session", n=n, ranks=[(r.rank, r.host) for r in info.ranks])
    x = T.fvector("x")
    f = synk.function([x], (T.sum(x), "sum"))
    synk.distribute()
    f_th = pytensor.function([x], T.sum(x))
    emit("ready")
    wait_go(spec)
    xn = np.arange(8, dtype=np.float32)
    xd = synk.data(xn)
    for _ in range(20):                       # first call (JIT / cache load) and warm-up
        out_s, out_t = f(xd), f_th(xn)
    ok = bool(float(out_s) == 28.0 and float(out_t) == 28.0)

    def per_call(fn, arg, budget):
        k, t = 0, time.perf_counter()          # calls for about ``budget`` seconds
        while True:
            fn(arg)
            k += 1
            dt = time.perf_counter() - t
            if dt >= 0.05 and k >= 10:
                break
        return max(10, int(budget / (dt / k)))

    inner_s = per_call(f, xd, spec["block_s"])
    inner_t = per_call(f_th, xn, spec["block_s"])
    ts_s, ts_t = [], []
    for _ in range(spec["blocks"]):
        t = time.perf_counter()
        for _ in range(inner_s):
            f(xd)
        ts_s.append((time.perf_counter() - t) / inner_s)
        t = time.perf_counter()
        for _ in range(inner_t):
            f_th(xn)
        ts_t.append((time.perf_counter() - t) / inner_t)
    emit("overhead", n=n, synk=ts_s, pytensor=ts_t, inner_synk=inner_s,
         inner_pytensor=inner_t, ok=ok, hosts=sorted({r.host for r in info.ranks}))
    synk.close()


if __name__ == "__main__":
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    {"synk_allreduce": synk_allreduce, "mpi_allreduce": mpi_allreduce,
     "overhead": overhead}[mode](spec)
