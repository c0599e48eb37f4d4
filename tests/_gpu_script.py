"""Scenarios of GPU ranks, each run as its own master process by tests/test_jax_gpu.py (a
pytest process that ran other JAX tests has JAX started already, which changes what a
session can do on a GPU: the master cannot pin itself to its GPU, warnings were printed
before).

    python tests/_gpu_script.py SCENARIO      (SYNK_GPU_SCRIPT_CPU=1: on JAX CPU ranks instead,
                                               to check the scenarios where no GPU is at hand)

Prints ``RESULT <json>`` lines and ``DONE``; exits 0 when the scenario's checks passed."""
import json
import os
import sys

import numpy as np
import pytensor
import pytensor.tensor as T

import synkhronos as synk

GPU = os.environ.get("SYNK_GPU_SCRIPT_CPU") != "1"
FORK = dict(use_gpu=True) if GPU else dict(use_gpu=False, mode="JAX")


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def platform(var):
    import jax
    value = var.container.storage[0]
    assert isinstance(value, jax.Array), type(value)
    return next(iter(value.devices())).platform


def graph():
    x = T.matrix("x", dtype="float32")
    w = pytensor.shared(np.ones(3, "float32"), name="w")
    f = synk.function([x], [(x.dot(w).sum(), "sum")], updates=[(w, w + T.mean(x, axis=0))])
    return f, w


def one_rank():
    """One GPU rank: values stay in GPU memory, the hot path moves nothing implicitly."""
    import jax
    synk.fork(1, **FORK)
    try:
        f, w = graph()
        x = T.matrix("x", dtype="float32")
        g = synk.function([x], [(x.sum(axis=0), "sum"), (x * 2, "gather")])
        synk.distribute()
        xd = synk.data(np.ones((4, 3), "float32"))
        f(xd)
        f(xd, batch=[0])                                # (compiles nothing new: warm)
        with jax.transfer_guard("disallow"):
            out = f(xd)
            picked = f(xd, batch=[3, 1])                # rows selected on the host, sent explicitly
            synk.all_reduce(w, "sum")
        assert out[0].dtype == np.float32
        np.testing.assert_allclose(picked[0], 2 * 3 * 4.0)   # w was 4 before the batch call
        np.testing.assert_allclose(synk.get_value(0, w), 5.0)
        # large inputs (page-locked shared memory on a GPU), rewritten between calls: each
        # call reads what the Data held when it was made, nothing later
        big = synk.data(np.zeros((1 << 16, 16), "float32"))                 # 4 MB
        for k in range(1, 6):
            big[:] = np.float32(k)
            sums, twice = g(big)
            big[:] = np.float32(-1)                                          # after the call
            np.testing.assert_array_equal(sums, np.full(16, k * (1 << 16), "float32"))
            assert twice.shape == (1 << 16, 16) and np.all(twice == 2 * k)
        from synkhronos.backends.jax import pinning
        status = pinning.status()
        if GPU:
            assert status.startswith("on") and "0 refused" in status, status
        result(platform=platform(w), pinning=status)
    finally:
        synk.close()


def two_on_one():
    """Two ranks sharing GPU 0: collectives through the host, said once (SYNK_GPUS=0,0)."""
    if GPU:
        os.environ["SYNK_GPUS"] = "0,0"
    synk.fork(2, **FORK)
    try:
        f, w = graph()
        v = pytensor.shared(np.zeros(1, "float32"), name="v")
        m = pytensor.shared(np.zeros((1, 1), "float32"), name="m")
        synk.function([], v.sum() + m.sum())            # (v, m: variables of the session)
        synk.distribute()
        for r in range(2):
            synk.set_value(r, w, np.full(3, r + 1, "float32"))
        synk.all_reduce(w, "sum")
        synk.all_reduce(w, "avg")
        np.testing.assert_allclose(synk.gather(w), 3.0)
        count = 1 << 21                                 # 8 MB a rank: page-locked staging
        parts = np.arange(2 * count, dtype=np.float32).reshape(2, count) % 1000
        for op, want in (("sum", parts.sum(0)), ("max", parts.max(0)), ("avg", parts.mean(0))):
            synk.scatter(v, parts.reshape(-1))
            synk.all_reduce(v, op)
            got = synk.gather(v, nd_up=1)
            np.testing.assert_array_equal(got, np.stack([want, want]))
        rows = np.random.default_rng(1).integers(-50, 50, (2 * 512, 1025)).astype("float32")
        synk.scatter(m, rows)                           # 2 MB a rank, 2-D: read from the GPU as it lies
        synk.all_reduce(m, "sum")
        want = rows[:512] + rows[512:]
        np.testing.assert_array_equal(synk.gather(m, nd_up=1), np.stack([want, want]))
        result(platform=platform(w))
    finally:
        synk.close()


def in_graph():
    """In-graph collectives (synkhronos.ops) in a graph PyTensor's JAX backend compiles:
    values and gradients against the serial computation on the whole batch."""
    from synkhronos import ops
    if GPU and synk.get_n_gpu() < 2:
        os.environ["SYNK_GPUS"] = "0,0"          # (one GPU: two ranks share it)
    n = synk.fork(2, **FORK)
    try:
        x = T.matrix("x")
        w = pytensor.shared(np.linspace(0.5, 1.5, 3), name="w")
        s = ops.all_reduce(T.tanh(x * w).sum(axis=0), "sum")          # over every rank's rows
        cost = T.sum(s ** 2) + T.sum(ops.all_gather(x * s) ** 2)
        g = T.grad(cost, w)
        f = synk.function([x], [(cost, None), (g, "sum")])
        synk.distribute()
        X = np.random.default_rng(0).standard_normal((7, 3))
        got_cost, got_g = f(X)
        xs = T.matrix("xs")
        S = T.tanh(xs * w).sum(axis=0)
        ref_cost = (T.sum(S ** 2) + T.sum((xs * S) ** 2))
        # every rank's cost holds the whole sum of squares; the gradient summed over ranks
        ref = pytensor.function([xs], [ref_cost, n * T.grad(ref_cost, w)], mode="FAST_COMPILE")(X)
        np.testing.assert_allclose(got_cost, ref[0], rtol=1e-9)
        np.testing.assert_allclose(got_g, ref[1], rtol=1e-9)
        result(n=n, cost=float(got_cost))
    finally:
        synk.close()


def precision():
    """The banner says what float32 matmuls are; matmul_precision reaches every rank."""
    n = synk.fork(1 if GPU else 2, matmul_precision="highest", **FORK)
    try:
        x = T.matrix("x", dtype="float32")
        w = pytensor.shared(np.random.default_rng(1).standard_normal((64, 64)).astype("float32"), name="w")
        f = synk.function([x], (x.dot(w), "gather"))
        synk.distribute()
        X = np.random.default_rng(2).standard_normal((8 * n, 64)).astype("float32")
        got = f(X)
        ref = X.astype(np.float64) @ w.get_value().astype(np.float64)
        err = float(np.max(np.abs(got - ref) / (np.abs(ref) + 1)))
        assert err < 1e-5, err          # TF32 would be ~1e-3
        result(n=n, max_rel_error=err)
    finally:
        synk.close()


def _trained(steps, fork, load=None, save=None):
    """``steps`` SGD steps of a small float32 regression (and 2 draws a rank of a random
    generator) in a session forked with ``fork``, from checkpoint ``load`` if given, saved
    to ``save`` if given: ``(w, draws)``."""
    rng = np.random.default_rng(4)
    X, Y = rng.standard_normal((16, 5)).astype("float32"), rng.standard_normal(16).astype("float32")
    n = synk.fork(2, **fork)
    try:
        x, y = T.matrix("x", dtype="float32"), T.vector("y", dtype="float32")
        w = pytensor.shared(np.zeros(5, "float32"), name="w")
        loss = T.mean((x.dot(w) - y) ** 2)
        step = synk.function([x, y], (loss, "avg"), updates=[(w, w - np.float32(0.1) * T.grad(loss, w))])
        gen = pytensor.shared(np.random.default_rng(9), name="gen")
        r_next, noise = T.random.normal(0, 1, size=(2,), rng=gen, return_next_rng=True)
        draw = synk.function([], (noise, "gather"), updates=[(gen, r_next)])
        synk.distribute()
        if load:
            synk.load(load)
        for _ in range(steps):
            step(X, Y)
        draws = draw().reshape(n, 2)
        if save:
            synk.save(save)
        return synk.get_value(0, w), draws
    finally:
        synk.close()


def checkpoint():
    """A checkpoint of CPU (numba) ranks resumed on the GPU and back: the parameters those
    of the run that never moved (float32 matmuls at full precision), each rank's
    generator its own stream on every device."""
    import tempfile
    cpu = dict(use_gpu=False)
    gpu = dict(FORK, matmul_precision="highest")
    if GPU and synk.get_n_gpu() < 2:
        os.environ["SYNK_GPUS"] = "0,0"
    with tempfile.TemporaryDirectory() as d:
        a, b = os.path.join(d, "a.npz"), os.path.join(d, "b.npz")
        ref, _ = _trained(6, cpu)
        _trained(2, cpu, save=a)
        _, on_gpu = _trained(2, gpu, load=a, save=b)
        w, back = _trained(2, cpu, load=b)
    np.testing.assert_allclose(w, ref, rtol=1e-5, atol=1e-6)
    for draws in (on_gpu, back):
        assert np.isfinite(draws).all() and not np.allclose(draws[0], draws[1])
    result(max_abs_diff=float(np.max(np.abs(w - ref))))


SCENARIOS = {f.__name__: f for f in (one_rank, two_on_one, in_graph, precision, checkpoint)}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
    print("DONE", flush=True)
