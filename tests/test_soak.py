"""Soak: thousands of mixed function calls and collectives with random sizes, every result
checked against a numpy model of every rank; resident memory, open file descriptors and
shared-memory segments of the master and of every worker must stay flat.

The program is random (seeded) but mirrored exactly: ``mw[r]``/``mu[r]`` model the values
of the shared variables ``w`` and ``u`` on rank ``r``.  Sizes are bounded, and a warm-up
first reaches the largest sizes, so that every growable buffer (mailboxes, staging Data,
collective slots) has its final size before the first measurement; after that, nothing may
grow: RSS growth < ``RSS_BOUND_MB`` per process, the same number of file descriptors and
of /dev/shm entries.

``test_soak_short`` (500 operations) runs in CI; ``test_soak_10000`` is ``slow``.  Both
print their figures (start / middle / end)."""
import gc
import os
import types

import numpy as np
import pytest
import pytensor
import pytensor.tensor as T

import synkhronos as synk
import synk_testutil as tu
from synkhronos.shards import split

N = 3
D = 4
MAX_ROWS = 600
MAX_U = 4000
RSS_BOUND_MB = 50.0
OPS = ("f1", "f2", "broadcast_w", "all_reduce_w", "set_get_w", "gather_w", "broadcast_u",
       "scatter_all_gather_u", "gather_u", "reduce_u", "all_reduce_u", "set_get_u", "data_churn")
REDUCERS = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min, "prod": np.prod}


@pytest.fixture(scope="module")
def S():
    synk.fork(N)
    try:
        x = T.matrix("x", dtype="float64")
        y = T.vector("y", dtype="float64")
        w = pytensor.shared(np.zeros(D), name="w")
        u = pytensor.shared(np.zeros(3), name="u")
        f1 = synk.function([x], [(T.sum(x.dot(y)), "sum"), (T.max(x), "max"),
                                 (x.sum(axis=1), "gather"), (T.sum(u), None)], bcast_inputs=[y])
        f2 = synk.function([x], (T.sum(x), "sum"),
                           updates=[(w, w * 0.5 + T.mean(x, axis=0), "avg")])
        synk.distribute()
        s = types.SimpleNamespace(prefix=tu.prefix(), f1=f1, f2=f2, w=w, u=u,
                                  pool=[synk.data(np.zeros((1, D))) for _ in range(4)],
                                  mw=[np.zeros(D) for _ in range(N)],
                                  mu=[np.zeros(3) for _ in range(N)], counts={})
        yield s
    finally:
        synk.close()


# ---- measurements -------------------------------------------------------------------------

def rss_mb(pid):
    with open(f"/proc/{pid}/status") as fh:
        for ln in fh:
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1]) / 1024.0
    return float("nan")


def n_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def sample(S):
    gc.collect()
    pids = {0: os.getpid(), **tu.worker_pids()}
    names = tu.shm_entries(S.prefix)
    size = sum(os.stat(os.path.join("/dev/shm", n)).st_size for n in names)
    return dict(rss={r: rss_mb(p) for r, p in pids.items()}, fds={r: n_fds(p) for r, p in pids.items()},
                shm=len(names), shm_mb=size / 2 ** 20)


# ---- the random program --------------------------------------------------------------------

def close(a, b, what):
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9, err_msg=what)


def x_input(S, rng, X):
    """X as a numpy array, a pooled Data (resized) or a fresh Data (dropped afterwards)."""
    k = rng.integers(0, 3)
    if k == 0:
        return X
    if k == 1:
        d = S.pool[rng.integers(0, len(S.pool))]
        d.set_value(X)
        return d
    return synk.data(X)


def step(S, rng, op, max_rows=MAX_ROWS, max_u=MAX_U):
    n = N
    S.counts[op] = S.counts.get(op, 0) + 1
    if op in ("f1", "f2"):
        rows = int(rng.integers(1, max_rows + 1)) if max_rows > 1 else 1
        if op == "f2" and rng.integers(0, 4) == 0:
            rows = max_rows
        X = rng.standard_normal((rows, D))
        ns = int(rng.integers(1, 4))
        if op == "f1":
            Y = rng.standard_normal(D)
            res = S.f1(x_input(S, rng, X), Y, num_slices=ns)
            close(res[0], np.sum(X @ Y), "f1 sum")
            close(res[1], X.max(), "f1 max")
            close(res[2], X.sum(axis=1), "f1 gather")
            b = split(rows, n)        # mode None: the master's result, or the first rank's
            src = next(r for r in range(n) if b[r + 1] > b[r])     # that has rows
            src = 0 if b[1] > b[0] else src                      # the master is rank 0
            close(res[3], S.mu[src].sum(), f"f1 sum(u) of rank {src}")
        else:
            res = S.f2(x_input(S, rng, X), num_slices=ns)
            close(res, X.sum(), "f2 sum")
            b = split(rows, n)
            for r in range(n):
                if b[r + 1] > b[r]:
                    S.mw[r] = S.mw[r] * 0.5 + X[b[r]:b[r + 1]].mean(axis=0)
    elif op == "broadcast_w":
        v = rng.standard_normal(D)
        synk.broadcast(S.w, v)
        S.mw = [v.copy() for _ in range(n)]
    elif op == "all_reduce_w":
        o = str(rng.choice(list(REDUCERS)))
        synk.all_reduce(S.w, op=o)
        red = REDUCERS[o](np.stack(S.mw), axis=0)
        S.mw = [red.copy() for _ in range(n)]
    elif op == "set_get_w":
        r = int(rng.integers(0, n))
        v = rng.standard_normal(D)
        synk.set_value(r, S.w, v)
        S.mw[r] = v
        r2 = int(rng.integers(0, n))
        close(synk.get_value(r2, S.w), S.mw[r2], "get_value w")
    elif op == "gather_w":
        close(synk.gather(S.w), np.stack(S.mw), "gather w")
    elif op == "broadcast_u":
        v = rng.standard_normal(int(rng.integers(0, max_u + 1)))
        synk.broadcast(S.u, v)
        S.mu = [v.copy() for _ in range(n)]
    elif op == "scatter_all_gather_u":
        v = rng.standard_normal(int(rng.integers(0, max_u + 1)))
        synk.scatter(S.u, v)
        b = split(len(v), n)
        S.mu = [v[b[r]:b[r + 1]].copy() for r in range(n)]
        if rng.integers(0, 2):
            synk.all_gather(S.u)
            S.mu = [v.copy() for _ in range(n)]
    elif op == "gather_u":
        g = synk.gather(S.u, nd_up=0)
        close(g, np.concatenate(S.mu), "gather u")
    elif op in ("reduce_u", "all_reduce_u"):
        if len({m.shape for m in S.mu}) > 1:           # reductions need equal shapes
            return step(S, rng, "broadcast_u", max_rows, max_u)
        o = str(rng.choice(["sum", "avg", "max", "min"]))
        red = REDUCERS[o](np.stack(S.mu), axis=0)
        if op == "reduce_u":
            close(synk.reduce(S.u, op=o, in_place=False), red, "reduce u")
        else:
            synk.all_reduce(S.u, op=o)
            S.mu = [red.copy() for _ in range(n)]
    elif op == "set_get_u":
        r = int(rng.integers(0, n))
        v = rng.standard_normal(int(rng.integers(0, max_u + 1)))
        synk.set_value(r, S.u, v)
        S.mu[r] = v
        r2 = int(rng.integers(0, n))
        close(synk.get_value(r2, S.u), S.mu[r2], "get_value u")
    elif op == "data_churn":
        ds = [synk.data(rng.standard_normal(int(rng.integers(1, 2000)))) for _ in range(3)]
        ds[0].set_value(rng.standard_normal(3000))
        ds[1].set_length(10)
        ds[2].free_memory()
        del ds
    else:  # pragma: no cover
        raise AssertionError(op)


def warm_up(S, rng):
    """Reach the largest sizes of everything that grows, then a few hundred random steps."""
    for _ in range(2):
        X = rng.standard_normal((MAX_ROWS, D))
        for d in S.pool:
            d.set_value(X)
        for _ in range(3):
            S.f1(X, X[0], num_slices=1)
            S.f1(synk.data(X), X[0])
            S.f2(X, num_slices=3)
        S.mw = [np.array(synk.get_value(r, S.w)) for r in range(N)]
        for r in range(N):
            synk.set_value(r, S.u, np.zeros(MAX_U))
        synk.broadcast(S.u, np.zeros(MAX_U))
        synk.scatter(S.u, np.zeros(MAX_U))
        synk.all_gather(S.u)
        synk.reduce(S.u, in_place=False)
        synk.all_reduce(S.u)
        synk.gather(S.u)
        S.mu = [np.zeros(MAX_U) for _ in range(N)]
    for _ in range(300):
        step(S, rng, OPS[rng.integers(0, len(OPS))])


def soak(S, n_ops, seed, request):
    rng = np.random.default_rng(seed)
    S.counts = {}
    warm_up(S, rng)
    S.counts = {}
    marks = {0: sample(S)}
    for i in range(n_ops):
        op = OPS[rng.integers(0, len(OPS))]
        try:
            step(S, rng, op)
        except Exception as e:
            raise AssertionError(f"step {i} ({op}) failed: {e!r}") from e
        if i + 1 == n_ops // 2:
            marks[i + 1] = sample(S)
    marks[n_ops] = sample(S)
    for r in range(N):                                     # final state, every rank
        close(synk.get_value(r, S.w), S.mw[r], f"final w rank {r}")
        close(synk.get_value(r, S.u), S.mu[r], f"final u rank {r}")

    lines = ["", f"soak: {n_ops} operations (n={N}), after warm-up; per-op counts {S.counts}",
             f"  {'after op':>8} " + " ".join(f"{'rss' + str(r) + ' MB':>10}" for r in range(N))
             + " " + " ".join(f"{'fds' + str(r):>6}" for r in range(N)) + f" {'/dev/shm':>9} {'MB':>7}"]
    for k, m in marks.items():
        lines.append(f"  {k:>8} " + " ".join(f"{m['rss'][r]:>10.1f}" for r in range(N)) + " "
                     + " ".join(f"{m['fds'][r]:>6}" for r in range(N))
                     + f" {m['shm']:>9} {m['shm_mb']:>7.2f}")
    tu.report(request.config, "\n".join(lines))

    first, last = marks[0], marks[n_ops]
    for r in range(N):
        growth = last["rss"][r] - first["rss"][r]
        assert growth < RSS_BOUND_MB, f"rank {r}: RSS grew by {growth:.1f} MB"
        assert last["fds"][r] == first["fds"][r], f"rank {r}: fds {first['fds'][r]} -> {last['fds'][r]}"
    assert last["shm"] == first["shm"], f"/dev/shm entries {first['shm']} -> {last['shm']}"
    assert last["shm_mb"] <= first["shm_mb"] + 1.0, (first["shm_mb"], last["shm_mb"])
    assert set(S.counts) == set(OPS)


def test_soak_short(S, request):
    soak(S, 500, seed=1, request=request)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak_10000(S, request):
    soak(S, 10_000, seed=2, request=request)
