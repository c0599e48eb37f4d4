"""The JAX device on CPU ranks (``synk.fork(mode="JAX")``): shared variables stay JAX arrays
on the device across calls and collectives, a call's hot path moves nothing implicitly
(``jax.transfer_guard("disallow")``: the master around a second call, the workers for their
whole life), outputs and updates keep their declared dtypes, partial updates of
``num_slices`` combine on the device, and a killed worker ends in ``WorkerDied``.

One small graph per case: every JAX function compiles in every process (~0.5 s each)."""
import collections
import json
import os

import numpy as np
import pytest
import pytensor
import pytensor.tensor as T

import synkhronos as synk
import synk_testutil as tu

jax = pytest.importorskip("jax")


def _on_device(var):
    return isinstance(var.container.storage[0], jax.Array)


@pytest.fixture(scope="class")
def S():
    # the workers run their whole life under the guard: not one implicit transfer anywhere
    saved = os.environ.get("JAX_TRANSFER_GUARD")
    os.environ["JAX_TRANSFER_GUARD"] = "disallow"
    try:
        n = synk.fork(2, mode="JAX", use_gpu=False)
    finally:
        if saved is None:
            os.environ.pop("JAX_TRANSFER_GUARD", None)
        else:
            os.environ["JAX_TRANSFER_GUARD"] = saved
    try:
        x = T.matrix("x", dtype="float32")
        y = T.vector("y", dtype="float32")
        w = pytensor.shared(np.ones(3, "float32"), name="w")
        c = pytensor.shared(np.zeros((4, 3), "float32"), name="c")
        f = synk.function([x], [(x.dot(w) * y.sum()).sum(), (T.sum(x, axis=0), "sum")], bcast_inputs=[y],
                          updates=[(w, w + T.mean(x, axis=0))])
        g = synk.function([x], (x.sum() + c.sum(), "sum"))
        from synkhronos import ops
        s = ops.all_reduce(T.tanh(x).sum(axis=0), "sum")     # an in-graph collective between two stretches
        h = synk.function([x], [(T.sum(s * w), None), (T.sum(ops.all_gather(x * s)), None)])
        synk.distribute()
        yield n, f, g, w, c, x, h
    finally:
        synk.close()


class TestOneSession:
    """Tests sharing one session of two JAX CPU ranks."""

    def test_storage_is_on_the_device_after_compiling(self, S):
        _, _, _, w, c, _, _ = S
        assert _on_device(w) and _on_device(c)
        assert synk.session_info().open

    def test_calls_keep_shared_values_on_the_device(self, S):
        n, f, _, w, _, _, _ = S
        X = np.arange(12, dtype="float32").reshape(4, 3)
        Y = np.ones(2, "float32")
        w0 = np.array(synk.get_value(0, w))
        out = f(X, Y)
        assert _on_device(w)
        assert w.container.storage[0].dtype == np.float32          # declared dtype, not JAX's float64
        assert out[0].dtype == np.float32 and out[1].dtype == np.float32
        np.testing.assert_allclose(out[1], X.sum(0))
        rows = [X[:2], X[2:]]
        for r in range(n):
            np.testing.assert_allclose(synk.get_value(r, w), w0 + rows[r].mean(0), rtol=1e-6)

    def test_second_call_under_transfer_guard(self, S):
        """Inputs go to the device once, explicitly; outputs come back explicitly; the update
        stays there.  (The master's share runs here, under the guard; the workers are under it
        since they started.)"""
        _, f, g, w, _, _, _ = S
        X = np.ones((6, 3), "float32")
        x_d, y_d = synk.data(X), synk.data(np.ones(2, "float32"))
        f(x_d, y_d)
        g(x_d)
        mine = jax.device_put(np.zeros(3, "float32"))        # explicit: allowed
        with jax.transfer_guard("disallow"):
            out = f(x_d, y_d)
            out_g = g(x_d)
            f(x_d, y_d, num_slices=2)                        # pieces moved one by one, combined on the device
            assert mine.shape == (3,)
        assert np.isfinite(out[0]) and out_g == pytest.approx(X.sum())
        assert _on_device(w)

    def test_collectives_keep_values_on_the_device(self, S):
        n, _, _, w, c, _, _ = S
        vals = [np.full(3, r + 1, "float32") for r in range(n)]
        for r in range(n):
            synk.set_value(r, w, vals[r])
        assert _on_device(w)
        synk.all_reduce(w, "sum")
        assert _on_device(w)
        np.testing.assert_allclose(synk.gather(w), np.stack([sum(vals)] * n))
        synk.set_value(0, w, np.arange(3, dtype="float32"))
        synk.broadcast(w)
        assert _on_device(w)
        np.testing.assert_allclose(synk.gather(w), np.stack([np.arange(3)] * n))
        synk.scatter(c, np.arange(24, dtype="float32").reshape(8, 3))
        assert _on_device(c)
        synk.all_gather(c)
        assert _on_device(c)
        np.testing.assert_allclose(synk.get_value(1, c), np.arange(24).reshape(8, 3))
        synk.reduce(w, "max")
        assert _on_device(w)
        with jax.transfer_guard("disallow"):            # collectives move values explicitly too
            synk.all_reduce(w, "avg")
        assert _on_device(w) and w.container.storage[0].dtype == np.float32

    def test_in_graph_collectives_under_transfer_guard(self, S):
        """A graph holding synkhronos.ops compiles in jitted stretches; the values the
        collectives exchange move explicitly (the workers run under the guard)."""
        n, _, _, w, _, _, h = S
        X = np.linspace(-1, 1, 15, dtype="float32").reshape(5, 3)
        h(X)
        with jax.transfer_guard("disallow"):
            got = h(X)
        s = np.tanh(X).sum(axis=0)
        W = np.asarray(synk.get_value(0, w))
        np.testing.assert_allclose(got[0], np.sum(s * W), rtol=1e-5)
        np.testing.assert_allclose(got[1], np.sum(X * s), rtol=1e-5)

    def test_sliced_updates_match_one_piece(self, S):
        """num_slices partial updates (avg weighted by rows) combine on the device to the
        same value as one call."""
        _, f, _, w, _, _, _ = S
        X = np.arange(30, dtype="float32").reshape(10, 3)
        Y = np.ones(2, "float32")
        synk.broadcast(w, np.zeros(3, "float32"))
        f(X, Y)
        one = synk.gather(w)
        synk.broadcast(w, np.zeros(3, "float32"))
        f(X, Y, num_slices=3)
        assert _on_device(w)
        np.testing.assert_allclose(synk.gather(w), one, rtol=1e-6)


class _RankPrecision(pytensor.graph.op.Op):
    """A host op (run between jitted stretches): the JAX matmul precision of the rank
    running it, as its index in PRECISIONS."""
    __props__ = ()
    runs_on_host = True

    def make_node(self):
        return pytensor.graph.basic.Apply(self, [], [T.lvector()])

    def compute(self):
        return np.array([PRECISIONS.index(jax.config.jax_default_matmul_precision or "default")], np.int64)

    def perform(self, node, inputs, outputs):
        outputs[0][0] = self.compute()


PRECISIONS = ["default", "high", "highest"]


def test_matmul_precision_reaches_every_rank():
    """synk.fork(matmul_precision=...) sets it in every rank (and JAX's own setting in the
    master is what the ranks get otherwise); the master's setting comes back at close()."""
    for asked, env in (("highest", None), (None, "high")):
        saved = os.environ.get("JAX_DEFAULT_MATMUL_PRECISION")
        before = jax.config.jax_default_matmul_precision
        if env:
            jax.config.update("jax_default_matmul_precision", env)
        try:
            n = synk.fork(2, mode="JAX", use_gpu=False, matmul_precision=asked)
            try:
                f = synk.function([], (_RankPrecision()(), "gather"))
                synk.distribute()
                assert list(f()) == [PRECISIONS.index(asked or env)] * n
            finally:
                synk.close()
            assert jax.config.jax_default_matmul_precision == (env or before)
        finally:
            jax.config.update("jax_default_matmul_precision", before)
            if saved is not None:
                os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = saved
        assert jax.config.jax_default_matmul_precision == before
    with pytest.raises(ValueError, match="matmul_precision must be"):
        synk.fork(2, mode="JAX", use_gpu=False, matmul_precision="fastest")
    with pytest.raises(ValueError, match="these ranks run numba"):
        synk.fork(2, use_gpu=False, matmul_precision="highest")


def _cache_entries(folder):
    """{program: (written ns, last read or write ns)} of a JAX compilation cache folder."""
    out = {}
    for name in os.listdir(folder):
        if name.endswith("-cache"):
            key = name[:-len("-cache")]
            with open(os.path.join(folder, key + "-atime"), "rb") as fh:
                used = int.from_bytes(fh.read(), "little")
            out[key] = (os.stat(os.path.join(folder, name)).st_mtime_ns, used)
    return out


def _compile_and_call(n):
    x = T.matrix("x", dtype="float64")
    f = synk.function([x], (T.tanh(x * 3.25).sum(), "sum"), name="cached")
    synk.distribute()
    assert np.isclose(f(np.ones((6, 2))), 12 * np.tanh(3.25))


def test_the_ranks_load_what_the_master_compiled(monkeypatch, tmp_path):
    """A first call compiles in the master, which writes the program to JAX's persistent
    cache (``SYNK_JAX_CACHE``, private to the user); the workers then read it there instead
    of compiling it again (an entry read after it was written).  The master's JAX settings
    are its own again after close(), and the next session loads the program too.  A folder
    that cannot be made and a bad ``SYNK_JAX_CACHE_MIN_S`` are refused before any process
    starts."""
    folder = tmp_path / "jaxcache"
    monkeypatch.setenv("SYNK_JAX_CACHE", str(folder))
    monkeypatch.setenv("SYNK_JAX_CACHE_MIN_S", "0")      # (this small graph compiles in less than 0.1 s)
    before = jax.config.jax_compilation_cache_dir
    synk.fork(3, mode="JAX", use_gpu=False)
    try:
        _compile_and_call(3)
    finally:
        synk.close()
    assert jax.config.jax_compilation_cache_dir == before
    assert os.stat(folder).st_mode & 0o777 == 0o700
    entries = _cache_entries(folder)
    assert any(k.startswith("jit_") for k in entries), entries
    read_later = [k for k, (written, used) in entries.items() if used - written > 1_000_000]
    assert read_later, entries           # (without the cache each rank compiles: nothing read)
    synk.fork(2, mode="JAX", use_gpu=False)       # the next session loads it too
    try:
        _compile_and_call(2)
    finally:
        synk.close()
    again = _cache_entries(folder)
    assert any(again[k][1] > entries[k][1] for k in read_later), (entries, again)
    monkeypatch.setenv("SYNK_JAX_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="SYNK_JAX_CACHE: cannot use"):
        synk.fork(2, mode="JAX", use_gpu=False)
    assert not tu.is_open() and tu.worker_children() == []
    monkeypatch.setenv("SYNK_JAX_CACHE", str(folder))
    monkeypatch.setenv("SYNK_JAX_CACHE_MIN_S", "soon")
    with pytest.raises(ValueError, match="SYNK_JAX_CACHE_MIN_S must be a number of seconds"):
        synk.fork(2, mode="JAX", use_gpu=False)
    assert not tu.is_open() and tu.worker_children() == []


def test_the_users_own_compilation_cache_is_kept(monkeypatch, tmp_path):
    """A cache the user set up (``jax_compilation_cache_dir``, with their thresholds) is the
    one every rank uses; ``SYNK_JAX_CACHE=off`` turns synkhronos' own off."""
    theirs = tmp_path / "theirs"
    settings = {"jax_compilation_cache_dir": str(theirs), "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_compilation_cache_max_size": 1 << 28}      # (bounded: JAX records each read)
    saved = {k: getattr(jax.config, k) for k in settings}
    for k, v in settings.items():
        jax.config.update(k, v)
    try:
        synk.fork(2, mode="JAX", use_gpu=False)
        try:
            _compile_and_call(2)
        finally:
            synk.close()
        assert jax.config.jax_compilation_cache_dir == str(theirs)
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
    entries = _cache_entries(theirs)
    assert [k for k, (written, used) in entries.items() if used - written > 1_000_000], entries
    monkeypatch.setenv("SYNK_JAX_CACHE", "off")
    synk.fork(2, mode="JAX", use_gpu=False)
    try:
        _compile_and_call(2)
        assert not jax.config.jax_compilation_cache_dir
    finally:
        synk.close()


def test_killed_worker_raises_worker_died_without_hanging():
    synk.fork(2, mode="JAX", use_gpu=False)
    x = T.vector("x", dtype="float64")
    f = synk.function([x], (x.sum(), "sum"))
    synk.distribute()
    assert f(np.ones(4)) == 4
    tu.kill_rank(1)
    with pytest.raises(synk.WorkerDied):
        f(np.ones(4))
    assert synk.session_info() is None


def test_device_out_of_memory_names_the_rank_and_applies_nothing(assert_clean):
    """XLA's RESOURCE_EXHAUSTED (real: an outer product of 2 TiB) becomes DeviceMemoryError
    naming the rank, the allocation and the inputs; no rank applies its update, and the
    session goes on.  On one rank only (a worker's longer shard), WorkerError names it."""
    synk.fork(2, mode="JAX", use_gpu=False)
    try:
        x = T.vector("x", dtype="float32")
        s = pytensor.shared(np.ones(8, "float32"), name="s")
        w = pytensor.shared(np.float32(0), name="w")
        f = synk.function([x], [(T.outer(x, x)[::2], "gather")], updates=[(w, w + 1)])
        g = synk.function([], [(T.outer(s, s)[::2], "gather")], sliceable_shareds=[s],
                          updates=[(w, w + 1)])
        synk.distribute()
        big = np.ones(1 << 21, "float32")              # each rank: 2^20 x 2^20 / 2 floats
        with pytest.raises(synk.DeviceMemoryError) as e:
            f(big)
        text = str(e.value)
        assert isinstance(e.value, MemoryError)
        assert "rank 0" in text and "GiB" in text and "(1048576,) float32" in text, text
        assert [float(synk.get_value(r, w)) for r in range(2)] == [0.0, 0.0]
        assert f(np.ones(4, "float32"))[0].shape == (2, 2)
        assert [float(synk.get_value(r, w)) for r in range(2)] == [1.0, 1.0]

        synk.set_value(1, s, big[:1 << 20])              # only rank 1 cannot
        with pytest.raises(synk.WorkerError) as e:
            g()
        assert e.value.ranks == [1] and "ran out of device memory" in str(e.value)
        assert [float(synk.get_value(r, w)) for r in range(2)] == [1.0, 1.0]
        synk.set_value(1, s, np.ones(8, "float32"))
        assert g()[0].shape == (8, 8)
        assert [float(synk.get_value(r, w)) for r in range(2)] == [2.0, 2.0]
    finally:
        synk.close()


def test_one_rank_step_out_of_memory_in_its_update_applies_nothing(assert_clean):
    """A one-rank training step dispatches its gradient and its update rule and waits once
    for both: an update rule that runs out of device memory (real: an outer product of
    2 TiB, once a shared vector is made large) raises DeviceMemoryError, and the parameters,
    the gradient and the rule's state stay as before the step; the next steps give the
    serial values as if it had never run."""
    from synkhronos.extensions import train, updates
    synk.fork(1, mode="JAX", use_gpu=False)
    try:
        x, y = T.matrix("x", dtype="float32"), T.vector("y", dtype="float32")
        w = pytensor.shared(np.zeros(3, "float32"), name="w")
        z = pytensor.shared(np.ones(4, "float32"), name="z")
        junk = pytensor.shared(np.zeros((2, 4), "float32"), name="junk")
        loss = T.mean((x.dot(w) - y) ** 2)

        def rule(loss_, params, **kw):
            g_upd, p_upd, g_shared = updates.momentum(loss_, params, **kw)
            return g_upd, list(p_upd) + [(junk, T.outer(z, z)[::2])], g_shared
        step = train.make_train_function(loss, [w], [x, y], rule, learning_rate=0.1)
        synk.distribute()
        rng = np.random.default_rng(5)
        X, Y = rng.standard_normal((8, 3)).astype("float32"), rng.standard_normal(8).astype("float32")
        step(X, Y)
        step(X, Y)                                     # warm: the one-rank path
        before = [np.array(synk.get_value(0, v), copy=True) for v in step.state_vars]
        synk.set_value(0, z, np.ones(1 << 21, "float32"))
        with pytest.raises(synk.DeviceMemoryError) as e:
            step(X, Y)
        assert "rank 0" in str(e.value) and "GiB" in str(e.value), str(e.value)
        for v, b in zip(step.state_vars, before):
            np.testing.assert_array_equal(synk.get_value(0, v), b, err_msg=str(v))
        synk.set_value(0, z, np.ones(4, "float32"))
        got = [float(step(X, Y)) for _ in range(2)]
        np.testing.assert_array_equal(synk.get_value(0, junk), np.ones((2, 4)))
    finally:
        synk.close()
    # the serial steps: two before the failed one, the two after it
    synk_free = train.make_train_function_theano(loss, [w], [x, y], updates.momentum, learning_rate=0.1)
    w.set_value(np.zeros(3, "float32"))
    want = [float(synk_free(X, Y)) for _ in range(4)]
    np.testing.assert_allclose(got, want[2:], rtol=1e-6)


def test_staged_all_reduce_adding_on_the_device(monkeypatch, tmp_path):
    """SYNK_STAGED_REDUCE=device (the default on GPUs): every rank reads the others' values
    from their slots and reduces on its device in rank order.  Three ranks: each op gives
    the rank-order numpy result and the same bits on every rank; int32 means round as the
    host's (a float64 accumulator: JAX's x64 mode is on); unequal shapes raise on
    every rank and change nothing; a 4 MB value takes the slots' threaded copy.  The
    session's timeline shows each rank's adds on its device."""
    monkeypatch.setenv("SYNK_STAGED_REDUCE", "gpu")
    with pytest.raises(ValueError, match="SYNK_STAGED_REDUCE='gpu' must be 'device' or 'host'"):
        synk.fork(2, mode="JAX", use_gpu=False)
    assert synk.session_info() is None
    monkeypatch.setenv("SYNK_STAGED_REDUCE", "device")
    trace = tmp_path / "trace.json"
    n = synk.fork(3, mode="JAX", use_gpu=False, timeline=str(trace))
    try:
        v = pytensor.shared(np.zeros((40, 3), "float32"), name="v")
        i = pytensor.shared(np.zeros(7, "int32"), name="i")
        h = pytensor.shared(np.zeros(5, "float16"), name="h")
        big = pytensor.shared(np.zeros(1 << 20, "float32"), name="big")
        s0 = pytensor.shared(np.float32(0), name="s0")
        e = pytensor.shared(np.zeros((0, 3), "float32"), name="e")
        synk.function([], v.sum() + i.sum() + h.sum() + big.sum() + s0 + e.sum())
        synk.distribute()
        assert "all_reduce adding on the device" in synk.session_info().device
        rng = np.random.default_rng(3)
        vals = [rng.standard_normal((40, 3)).astype("float32") for _ in range(n)]
        ufunc = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
        for op in ("sum", "prod", "max", "min", "avg"):
            for r in range(n):
                synk.set_value(r, v, vals[r])
            synk.all_reduce(v, op)
            got = [np.asarray(synk.get_value(r, v)) for r in range(n)]
            assert _on_device(v)
            acc = vals[0]
            for x in vals[1:]:
                acc = ufunc.get(op, np.add)(acc, x)
            if op == "avg":
                np.testing.assert_allclose(got[0], acc / np.float32(n), rtol=1e-6)
            else:
                np.testing.assert_array_equal(got[0], acc)
            for g in got[1:]:
                np.testing.assert_array_equal(g, got[0])          # every replica the same bits
        for r in range(n):
            synk.set_value(r, i, np.arange(7, dtype="int32") * (r + 1))
        synk.all_reduce(i, "max")
        np.testing.assert_array_equal(synk.get_value(2, i), np.arange(7) * 3)
        for r in range(n):
            synk.set_value(r, i, np.arange(7, dtype="int32") + (r == 2))
        synk.all_reduce(i, "avg")          # a float64 mean (JAX's x64 mode is on), rounded as the host rounds
        np.testing.assert_array_equal(synk.get_value(1, i), np.arange(7))
        for r in range(n):
            synk.set_value(r, h, np.full(5, 30000 if r < 2 else -1000, "float16"))
        synk.all_reduce(h, "sum")                                   # float32 accumulator
        np.testing.assert_array_equal(synk.get_value(0, h), np.full(5, 59008, "float16"))
        for r in range(n):
            synk.set_value(r, h, np.float16([65504, -65504, 0, 1, -1]))
        synk.all_reduce(h, "avg")                                   # at float16's edge: no inf
        np.testing.assert_array_equal(synk.get_value(2, h), np.float16([65504, -65504, 0, 1, -1]))
        for r in range(n):
            synk.set_value(r, s0, np.float32(r + 0.25))
        synk.all_reduce([s0, e], "sum")                             # 0-d and empty values
        assert [float(synk.get_value(r, s0)) for r in range(n)] == [3.75] * n
        assert synk.get_value(1, e).shape == (0, 3)
        synk.set_value(1, v, np.ones((2, 3), "float32"))
        before = [np.asarray(synk.get_value(r, v)).copy() for r in range(n)]
        with pytest.raises(ValueError, match="same shape on every rank"):
            synk.all_reduce(v, "sum")
        for r in range(n):
            np.testing.assert_array_equal(synk.get_value(r, v), before[r])
        for r in range(n):
            synk.set_value(r, big, np.full(1 << 20, r + 0.5, "float32"))
        synk.all_reduce(big, "sum")
        assert [float(synk.get_value(r, big)[-1]) for r in range(n)] == [4.5] * n
    finally:
        synk.close()
    adds = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "adding on the device"]
    by_rank = collections.Counter(e["pid"] for e in adds)
    # 5 float32 ops, int32 max and mean, 2 float16, the 0-d + empty pair, 4 MB (not the
    # unequal shapes: refused before any add)
    assert by_rank == {r: 11 for r in range(n)}, by_rank
    assert {e["args"]["bytes"] for e in adds} >= {480, 28, 10, 4, 4 << 20}


def test_staged_device_all_reduce_with_a_rank_killed_ends_in_worker_died(monkeypatch, assert_clean):
    """A rank killed while the others loop on 8 MB all-reduces added on the device (every
    moment of one: copying into the slots, reading them to the device, adding, voting):
    WorkerDied naming it, within seconds, the session closed, nothing left behind."""
    import threading
    import time
    monkeypatch.setenv("SYNK_STAGED_REDUCE", "device")
    synk.fork(3, mode="JAX", use_gpu=False)
    try:
        big = pytensor.shared(np.ones(1 << 21, "float32"), name="big")
        synk.function([], big.sum())
        synk.distribute()
        synk.all_reduce(big, "max")
        pid = tu.pid_of(2)
        killer = threading.Timer(0.3, tu.kill_rank, (2,))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(synk.WorkerDied, match="rank 2"):
            for _ in range(10000):
                synk.all_reduce(big, "max")
        assert time.monotonic() - t0 < 10
        killer.join()
        assert not tu.pid_running(pid)
        assert synk.session_info() is None
    finally:
        synk.close()
    assert_clean()
