"""Programs the multi-host tests run under ``mpiexec`` (``python _mpi_scripts.py SCENARIO
ARGS``).  Every MPI process runs the program; ``synk.fork()`` returns only in the master
(MPI rank 0), which prints ``SYNK-INFO {json}`` once the session is up and ``SYNK-RESULT
{json}`` at the end.  The scenarios of what works are here, those of faults (a rank lost,
an error, an interrupt, the parameter server, checkpoints and elastic runs) in
``_mpi_faults.py``."""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fault_scripts import _result  # noqa: E402  (one emitter for every script)
from _mpi_common import Checks, _session  # noqa: E402
import _mpi_faults as faults  # noqa: E402


def scenario_features(n):
    """Every function feature and collective, checked against numpy on the same data."""
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos.shards import split
    info = _session(n)
    n = info.n
    ck = Checks()
    rng = np.random.default_rng(0)
    x = T.matrix("x", dtype="float64")
    y = T.vector("y", dtype="float64")
    w = pytensor.shared(np.zeros(4), name="w")
    S = pytensor.shared(np.zeros((0, 4)), name="S")           # sliceable, scattered
    v = pytensor.shared(np.zeros(5), name="v")
    iv = pytensor.shared(np.zeros(3, np.int32), name="iv")
    f = synk.function([x], [(T.sum(x.dot(y)), "sum"), (T.max(x), "max"), (T.min(x), "min"),
                            (x.sum(axis=1), "gather"), (T.mean(x), "avg"), (T.sum(w), None)],
                      bcast_inputs=[y], updates=[(w, w + x.sum(axis=0))])
    g = synk.function([], [(T.sum(S), "sum"), (S.shape[0], "sum")], sliceable_shareds=[S])
    synk.function([], [(T.sum(v), "sum"), (T.sum(iv), "sum")])     # registers v and iv
    synk.distribute()
    X = rng.integers(-5, 6, (23, 4)).astype(np.float64)
    Y = rng.integers(-3, 4, 4).astype(np.float64)
    model_w = [np.zeros(4) for _ in range(n)]

    for batch in (None, 17, slice(3, 20), [5, 0, 22, 7, 7, 1, 13, 2, 9]):
        rows = np.arange(23) if batch is None else (np.arange(batch) if isinstance(batch, int) else
                                                     np.arange(batch.start, batch.stop)
                                                     if isinstance(batch, slice) else np.asarray(batch))
        out = f(X, Y, batch=batch)
        sel = X[rows]
        ck.close(f"f sum batch={batch}", out[0], (sel @ Y).sum())
        ck.close(f"f gather batch={batch}", out[3], sel.sum(axis=1))
        ck.close(f"f avg batch={batch}", out[4], sel.mean())
        b = split(len(rows), n)
        for r in range(n):
            if b[r + 1] > b[r]:
                model_w[r] = model_w[r] + sel[b[r]:b[r + 1]].sum(axis=0)
    for r in range(n):
        ck.close(f"w after batches, rank {r}", synk.get_value(r, w), model_w[r])
    d = synk.data(X)
    out = f(d, Y, num_slices=3)
    ck.close("f sum num_slices=3, Data", out[0], (X @ Y).sum())
    ck.close("f avg num_slices=3", out[4], X.mean())
    # data of over 32 KB for the other host travels as its own MPI message (smaller: inside
    # the command's): whole, a range of rows, rows by index
    Xb = rng.integers(-5, 6, (6000, 4)).astype(np.float64)
    db = synk.data(Xb)
    for batch in (None, slice(100, 5900), rng.permutation(6000)[:5000]):
        rows = np.arange(6000)[batch] if batch is not None else np.arange(6000)
        out = f(db, Y, batch=batch)
        ck.close(f"f sum, 188 KB Data, batch {type(batch).__name__}", out[0], (Xb[rows] @ Y).sum())
        ck.close(f"f gather, 188 KB Data, batch {type(batch).__name__}", out[3], Xb[rows].sum(axis=1))
    # ---- scatter (values of different lengths), batch_s, sliceable shareds
    T1 = rng.integers(0, 9, (13, 4)).astype(np.float64)
    V1 = np.arange(5.0 * n)
    synk.scatter([S, v], [T1, V1])
    bs = split(13, n)
    ck.equal("get_lengths S", synk.get_lengths(S), [bs[r + 1] - bs[r] for r in range(n)])
    out = g()
    ck.close("g sum (whole sliceable)", out[0], T1.sum())
    ck.close("g rows", out[1], 13)
    sel = [[0] if bs[r + 1] > bs[r] else [] for r in range(n)]
    out = g(batch_s=sel)
    ck.close("g batch_s", out[0], sum(T1[bs[r]] .sum() for r in range(n) if bs[r + 1] > bs[r]))
    out = g(num_slices=2)
    ck.close("g num_slices", out[0], T1.sum())
    # ---- collectives
    parts = [rng.integers(-9, 10, 5).astype(np.float64) for _ in range(n)]
    for op, fn in (("sum", np.sum), ("max", np.max), ("min", np.min), ("avg", np.mean), ("prod", np.prod)):
        for r in range(n):
            synk.set_value(r, v, parts[r])
        synk.all_reduce(v, op=op)
        want = fn(np.stack(parts), axis=0)
        ck.close(f"all_reduce {op}", synk.gather(v), np.stack([want] * n))
    ints = [rng.integers(-9, 10, 3).astype(np.int32) for _ in range(n)]
    for r in range(n):
        synk.set_value(r, iv, ints[r])
    synk.all_reduce(iv, op="avg")
    ck.equal("all_reduce int avg", synk.get_value(n - 1, iv),
             np.rint(np.mean(np.stack(ints).astype(np.float64), axis=0)).astype(np.int32))
    for r in range(n):
        synk.set_value(r, v, parts[r])
    res = synk.reduce(v, op="sum", in_place=False)
    ck.close("reduce result", res, np.sum(np.stack(parts), axis=0))
    ck.close("reduce leaves master", synk.get_value(0, v), parts[0])
    synk.reduce(v, op="max")
    ck.close("reduce in place", synk.get_value(0, v), np.max(np.stack(parts), axis=0))
    ck.close("reduce leaves workers", synk.get_value(n - 1, v), parts[n - 1])
    synk.broadcast(v, np.arange(5.0) * 7)
    ck.close("broadcast", synk.gather(v), np.stack([np.arange(5.0) * 7] * n))
    unequal = [np.arange(float(r + 1)) for r in range(n)]
    for r in range(n):
        synk.set_value(r, v, unequal[r])
    g1 = synk.gather(v)
    ck.equal("gather unequal is a list", [len(p) for p in g1], [r + 1 for r in range(n)])
    ck.close("gather nd_up=0", synk.gather(v, nd_up=0), np.concatenate(unequal))
    ck.equal("get_shapes", synk.get_shapes(v), [(r + 1,) for r in range(n)])
    for op in ("sum", "avg"):           # shapes that differ between ranks (and hosts): refused
        try:                            # on every rank, nothing changed, the session goes on
            synk.all_reduce(v, op=op)
            ck.equal(f"all_reduce {op} of unequal shapes raises", "no error", "ValueError")
        except ValueError as e:
            ck.equal(f"all_reduce {op} of unequal shapes: the message",
                     "needs the same shape on every rank" in str(e) and str([(r + 1,) for r in range(n)]) in str(e),
                     True)
        ck.close(f"all_reduce {op} of unequal shapes changed nothing", np.concatenate(synk.gather(v)),
                 np.concatenate(unequal))
    synk.all_gather(v)
    ck.close("all_gather", synk.get_value(n - 1, v), np.concatenate(unequal))
    synk.set_value(n - 1, v, np.full(7, 3.0), batch=slice(1, 5))
    ck.close("set_value batch, remote rank", synk.get_value(n - 1, v), np.full(4, 3.0))
    synk.set_value(n - 1, v, synk.data(np.arange(9.0)), batch=[8, 0, 4])
    ck.close("set_value index batch, Data", synk.get_value(n - 1, v), np.array([8.0, 0.0, 4.0]))
    # shapes that differ between the hosts, one small and one large (the host buffers are
    # sized by the host's largest rank before the hosts compare shapes): refused alike
    straddle = [np.arange(5.0)] * (n - 1) + [np.arange(20000.0)]
    for r in range(n):
        synk.set_value(r, v, straddle[r])
    try:
        synk.all_reduce(v, op="sum")
        ck.equal("all_reduce of a small and a large shape raises", "no error", "ValueError")
    except ValueError as e:
        ck.equal("all_reduce of a small and a large shape: the message",
                 "needs the same shape on every rank" in str(e), True)
    ck.close("all_reduce of a small and a large shape changed nothing", np.concatenate(synk.gather(v)),
             np.concatenate(straddle))
    # a variable that keeps growing: the host buffers between hosts are replaced, and the
    # replaced ones must be unmapped (a deleted segment still mapped keeps its memory)
    from synk_testutil import deleted_mappings
    mapped, held = deleted_mappings(), []
    for size in (1 << 14, 1 << 16, 1 << 18, 1 << 19):
        synk.broadcast(v, np.ones(size))
        synk.all_reduce(v, op="sum")
        held.append(max(0, deleted_mappings() - mapped))
    ck.close("all_reduce of a grown variable", synk.get_value(n - 1, v), np.full(1 << 19, float(n)))
    if synk.session_info().device.startswith(f"{n} JAX"):
        # JAX ranks keep device copies, not the slots: the master still maps the value
        # buffers its host's other rank published last (a peer's two current buffers, one
        # of each parity: with 3 ranks both were replaced), never older ones: no growth
        ck.equal(f"replaced host buffers unmapped (at most a peer's two; held {held})",
                 max(held) <= 2 and held[-1] <= held[0], True)
    else:
        ck.equal("replaced host buffers unmapped", held[-1], 0)
    synk.close()
    _result(checks=ck.n, failed=ck.failed, n=n, hosts=sorted({r.host for r in info.ranks}))


def scenario_sizes(n):
    """Calls whose inputs grow and shrink (the master's staging buffers keep their names
    while the other host's copies of them are resized), as numpy arrays, as a
    ``synk.data`` resized in place, with index batches of varying lengths, and ``scatter``
    of varying sizes: every result against numpy."""
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    _session(n)
    x = T.matrix("x", dtype="float64")
    f = synk.function([x], [(T.sum(x, axis=0), "sum"), (x * 2, "gather")])
    v = pytensor.shared(np.zeros((1, 3)), name="v")
    g = synk.function([], (T.sum(v, axis=0), "sum"))
    bc = T.matrix("b", dtype="float64")
    h = synk.function([x], (T.sum(x, axis=0) + T.sum(bc, axis=0) / int(n), "sum"), bcast_inputs=[bc])
    synk.distribute()
    rng = np.random.default_rng(5)
    wrong, raised = [], []
    d = synk.data(np.zeros((1, 3)))
    sizes = (1, 8, 11, 3, 1, 30, 44, 2, 200, 290, 9, 5000, 7000, 12, 1, 0, 40, 7000, 8)
    n = int(n)
    for how in ("array", "data", "index", "scatter", "bcast", "set_value"):
        for rows in sizes:
            data = rng.standard_normal((rows, 3))
            try:
                if how == "array":
                    got = f(data)
                elif how == "data":
                    d.set_value(data)
                    got = f(d)
                elif how == "index":           # (the data: 7000 rows; the batch: `rows` of them)
                    whole = rng.standard_normal((7000, 3))
                    idx = rng.permutation(7000)[:rows]
                    got, data = f(whole, batch=idx), whole[idx]
                elif how == "scatter":          # every rank's rows of v, summed over ranks
                    synk.scatter(v, data)
                    got = [g(), data * 2]
                elif how == "bcast":            # every rank's sum of b, over n ranks: b's sum
                    got = [h(np.zeros((n, 3)), data), data * 2]
                else:                           # the last rank (the other host) holds it all
                    synk.scatter(v, np.zeros((0, 3)))
                    synk.set_value(n - 1, v, data)
                    got = [g(), data * 2]
            except synk.SynkError as e:
                raised.append((how, rows, str(e)[-300:]))
                continue
            if not (np.allclose(got[0], data.sum(axis=0), rtol=1e-12, atol=1e-12)
                    and np.array_equal(got[1], data * 2)):
                wrong.append((how, rows))
    synk.close()
    _result(wrong=wrong, raised=raised)


def scenario_train(n, steps, rule="momentum", shard="0"):
    """An MLP trained with the training kit, against the same training in one process
    (``shard`` "1": the rule's state sharded over the ranks, whose lengths are reported)."""
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos.extensions import train, updates
    info = _session(n)
    rng = np.random.default_rng(1)
    X = rng.standard_normal((96, 8))
    Y = rng.integers(0, 3, 96).astype(np.int64)
    x = T.matrix("x", dtype="float64")
    yv = T.vector("y", dtype="int64")
    W1 = pytensor.shared(rng.standard_normal((8, 16)) * 0.3, name="W1")
    W2 = pytensor.shared(rng.standard_normal((16, 3)) * 0.3, name="W2")
    p = T.special.softmax(T.tanh(x.dot(W1)).dot(W2), axis=1)
    loss = -T.mean(T.log(p[T.arange(yv.shape[0]), yv]))
    step = train.make_train_function(loss, [W1, W2], [x, yv], getattr(updates, rule), learning_rate=0.1,
                                     shard_updates=shard == "1")
    synk.distribute()
    start = step.snapshot()
    lengths = [synk.get_lengths(v) for v in getattr(step, "sharded_vars", [])]
    order = [rng.permutation(96)[:48] for _ in range(int(steps))]
    losses = [float(step(X, Y, batch=idx)) for idx in order]
    par = [synk.get_value(r, W1) for r in range(info.n)]
    synk_params = [W1.get_value(), W2.get_value()]
    step.restore(start)
    serial = [float(step.serial(X[idx], Y[idx])) for idx in order]
    ser_params = [W1.get_value(), W2.get_value()]
    synk.close()
    _result(loss_first=losses[0], loss_last=losses[-1], serial_last=serial[-1],
            loss_diff=max(abs(a - b) for a, b in zip(losses, serial)),
            param_diff=max(float(np.max(np.abs(a - b))) for a, b in zip(synk_params, ser_params)),
            ranks_agree=max(float(np.max(np.abs(par[r] - par[0]))) for r in range(info.n)), lengths=lengths)




# test_ops' cases run across hosts: every verb once, roots other than the master's (each
# case compiles in every rank: the whole list took 40 s on numba, 58 s on JAX ranks)
HOST_OPS = ("all_reduce_sum", "all_reduce_max", "all_gather", "reduce_scatter_sum_counts", "broadcast_1",
            "reduce_sum_1")


def scenario_in_graph(n):
    """test_ops' in-graph collectives (``synkhronos.ops``: values, the summed cost and its
    gradients against the serial graph) on ranks of several hosts, unequal shards, plus a
    shape mismatch between ranks (raised, the session goes on) and the ranks' own ids."""
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos import ops
    import test_ops as to
    info = _session(n)
    n = info.n
    ck = Checks()
    rng = np.random.default_rng(7)
    v = to.symbols()
    v.w = pytensor.shared(rng.uniform(0.5, 1.5, to.D), name="w")
    fs = {name: to.build(v, name) for name in HOST_OPS}
    x = v.x
    mismatch = synk.function([x], (T.sum(ops.all_reduce(x.sum(axis=1))), "sum"))
    ids = synk.function([x], (T.stack([ops.this_rank(), ops.n_ranks()]), "gather"), on_unused_input="ignore")
    synk.distribute()
    counts = np.zeros(n, np.int64)
    for i in range(to.M):                     # reduce_scatter counts: M rows, uneven, a zero among them
        counts[(2 * i) % n] += 1
    data = (rng.standard_normal((to.N, to.D)), rng.standard_normal(to.D), rng.standard_normal((to.M, to.D)),
            rng.standard_normal((to.N, to.D)), counts)
    for name in HOST_OPS:
        got = fs[name](*data)
        want = to.serial_fn(v, name, n)(*data)
        for g, e, what in zip(got, want, ["J", "dJ/dw", "dJ/dx", "value"]):
            ck.close(f"{name}: {what}", g, e)
    try:
        mismatch(data[0])
        ck.equal("a shape mismatch between ranks raises", "no error", "an error")
    except Exception as e:                   # (every rank raised; the master reports it)
        ck.equal("a shape mismatch names the shapes", "shape" in str(e), True)
    ck.equal("rank ids", np.asarray(ids(data[0])).reshape(-1, 2).tolist(), [[r, n] for r in range(n)])
    got = fs["all_reduce_sum"](*data)                # (the session goes on)
    ck.close("after the mismatch", got[0], to.serial_fn(v, "all_reduce_sum", n)(*data)[0])
    synk.close()
    _result(failed=ck.failed, checks=ck.n, counts=counts.tolist())


def scenario_uneven(n):
    """A scan whose length differs between ranks (so their numbers of in-graph collectives
    differ): the longer ranks on the master's own host only, all of the master's host, all
    of the other host.  Each call raises at once, naming the ranks that finished, instead of
    waiting for ever (the first call of a function has no timeout), applies nothing, and
    the session goes on."""
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos import ops
    info = _session(n)
    x, longer = T.matrix("x"), T.lvector("longer")
    steps = T.switch(T.any(T.eq(longer, ops.this_rank())), 5, 3)
    u = pytensor.shared(np.zeros(3), name="u")
    out = pytensor.scan(lambda i, acc, s: acc + ops.all_reduce(s * i), sequences=[T.arange(1, 10)],
                        non_sequences=[x.sum(axis=0)], outputs_info=[T.zeros((3,), "float64")], n_steps=steps,
                        return_updates=False)
    f = synk.function([x], (out[-1], None), updates=[(u, u + 1)], bcast_inputs=[longer])
    g = synk.function([x], (ops.all_reduce(x.sum(axis=0)), None))
    synk.distribute()
    home = info.ranks[0].host
    cases = {"rank 0": [0], "the master's host": [r.rank for r in info.ranks if r.host == home],
             "the other host": [r.rank for r in info.ranks if r.host != home]}
    X = np.ones((2 * info.n, 3))
    res = {}
    for name, ranks in cases.items():
        t0 = time.monotonic()
        try:
            f(X, np.asarray(ranks, np.int64))
            res[name] = ("no error", 0.0)
        except Exception as e:                     # (WorkerError or the master's own)
            res[name] = (type(e).__name__ + ": " + str(e).strip().splitlines()[-1][:300], time.monotonic() - t0)
    res["unchanged"] = all(np.array_equal(synk.get_value(r, u), np.zeros(3)) for r in range(info.n))
    res["after"] = np.asarray(g(X)).tolist()
    synk.close()
    _result(**res, n=info.n)


def scenario_repeat(n, calls):
    """Many small commands between hosts in a row, a busy loop beside them: each step's
    update (different on every rank) and a cross-host average of it, checked exactly (the
    master once took a host that had finished the average for one that never joined it)."""
    import subprocess
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    info = _session(n)
    x = T.matrix("x", dtype="float64")
    v = pytensor.shared(np.zeros(3), name="v")
    step = synk.function([x], [], updates=[(v, v + x.sum(axis=0))])
    synk.distribute()
    X = np.random.default_rng(1).integers(-4, 5, (4 * info.n, 3)).astype(np.float64)
    mean_sum = X.sum(axis=0) / info.n       # the average of the ranks' row sums, however split (exact)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    errors, want = [], np.zeros(3)
    try:
        for i in range(int(calls)):
            step(X)
            want = want + mean_sum
            try:
                synk.all_reduce(v, op="avg")
            except Exception as e:
                errors.append(f"call {i}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
                break
    finally:
        hog.kill()
        hog.wait()
    got = [synk.get_value(r, v).tolist() for r in range(info.n)]
    synk.close()
    _result(errors=errors, calls=int(calls), exact=all(g == want.tolist() for g in got), got=got[:2],
            want=want.tolist())


if __name__ == "__main__":
    name, args = sys.argv[1], sys.argv[2:]
    {"features": scenario_features, "sizes": scenario_sizes, "train": scenario_train, "in_graph": scenario_in_graph,
     "uneven": scenario_uneven, "repeat": scenario_repeat, "fault": faults.scenario_fault,
     "step_fails": faults.scenario_step_fails, "ctrl_c_slow": faults.scenario_ctrl_c_slow,
     "root_lost": faults.scenario_root_lost, "ps": faults.scenario_ps, "resume": faults.scenario_resume,
     "elastic": faults.scenario_elastic, "close_lost": faults.scenario_close_lost}[name](*args)
