"""``synk.save`` / ``synk.load``: every shared variable of the session's functions, from every
rank, into one .npz file and back, at the same or another number of ranks.

One small float64 model (a linear softmax-free regression trained with Adam through
``make_train_function``), a per-rank variable (different on every rank) and a scattered
one (``synk.scatter``: lengths differ by rank).  Saved at 2 ranks after 3 steps; the run
goes on 3 steps; loading the file and taking the same 3 steps gives the same losses
exactly at 2 ranks, and to rounding at 1 and 3 ranks (the per-rank variable becomes the
saved ranks' mean there, the scattered one is split again).  Damaged, foreign and
other-model files raise ``CheckpointError`` and change nothing."""
import json
import os
import signal
import stat
import threading
import time
import zipfile

import numpy as np
import pytensor
import pytensor.tensor as T
import pytest

import synkhronos as synk
import synk_testutil as tu
from synkhronos.extensions import train, updates

RNG = np.random.default_rng(7)
X = RNG.standard_normal((12, 4))
Y = RNG.integers(0, 3, 12).astype("int32")
DATA = np.arange(20.0).reshape(10, 2)          # scattered: 5 + 5 rows at 2 ranks, 4+3+3 at 3


def build(width=3):
    """The model, its training step and the functions that own the other variables."""
    rng = np.random.default_rng(0)
    W = pytensor.shared(rng.standard_normal((4, width)), name="W")
    b = pytensor.shared(np.zeros(width), name="b")
    pr = pytensor.shared(np.zeros(2), name="per_rank")
    X_s = pytensor.shared(np.zeros((0, 2)), name="X_s")
    x, y = T.matrix("x"), T.ivector("y")
    target = T.eq(y[:, None], T.arange(width)).astype("float64")
    loss = T.mean((T.tanh(x.dot(W) + b) - target) ** 2)
    step = train.make_train_function(loss, [W, b], [x, y], updates.adam, learning_rate=0.05)
    probe = synk.function([], [(pr.sum(), "gather"), (X_s.sum(), "sum")], sliceable_shareds=[X_s])
    synk.distribute()
    return step, probe, pr, X_s, [W, b]


def steps(step, k=3):
    return [float(step(X, Y)) for _ in range(k)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint at 2 ranks after 3 steps, and the losses of the 3 steps after it."""
    path = str(tmp_path_factory.mktemp("ckpt") / "run.npz")
    tu.fork(2)
    try:
        step, probe, pr, X_s, params = build()
        steps(step)
        synk.scatter(X_s, DATA)
        for r in range(2):
            synk.set_value(r, pr, np.full(2, float(r + 1)))
        manifest = synk.save(path, state={"epoch": 1, "position": 36})
        after = steps(step)
        per_rank = synk.gather(pr)
    finally:
        synk.close()
    return dict(path=path, manifest=manifest, after=after, per_rank=per_rank)


def test_file_is_private_and_numpy_readable(saved):
    assert stat.S_IMODE(os.stat(saved["path"]).st_mode) == 0o600
    with np.load(saved["path"]) as z:
        manifest = json.loads(z["__manifest__"].tobytes())
        kinds = {e["name"]: e["kind"] for e in manifest["variables"]}
        assert manifest["n_ranks"] == 2 and manifest["state"] == {"epoch": 1, "position": 36}
        assert kinds["W"] == kinds["b"] == "replicated" and kinds["per_rank"] == "per_rank"
        assert kinds["X_s"] == "sharded"
        key = next(e["key"] for e in manifest["variables"] if e["name"] == "per_rank")
        np.testing.assert_array_equal(z[key], [[1.0, 1.0], [2.0, 2.0]])
    assert not [f for f in os.listdir(os.path.dirname(saved["path"])) if f.endswith(".tmp")]


def test_resume_same_size_continues_exactly(saved):
    tu.fork(2)
    try:
        step, probe, pr, X_s, _ = build()
        assert synk.load(saved["path"]) == {"epoch": 1, "position": 36}
        np.testing.assert_array_equal(synk.gather(pr), [[1.0, 1.0], [2.0, 2.0]])
        assert synk.get_lengths(X_s) == [5, 5]
        assert steps(step) == saved["after"]          # Adam's moments and step count came back too
    finally:
        synk.close()


@pytest.mark.parametrize("n", [1, 3])
def test_resume_other_sizes(saved, n):
    tu.fork(n)
    try:
        step, probe, pr, X_s, _ = build()
        synk.load(saved["path"])
        np.testing.assert_array_equal(synk.gather(pr), np.full((n, 2), 1.5))   # the saved ranks' mean
        assert sum(synk.get_lengths(X_s)) == 10
        np.testing.assert_array_equal(synk.gather(X_s, nd_up=0), DATA)
        np.testing.assert_allclose(steps(step), saved["after"], rtol=1e-12)
    finally:
        synk.close()


def test_bad_files_change_nothing(saved, tmp_path):
    raw = open(saved["path"], "rb").read()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(raw[: len(raw) // 2])
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, a=np.ones(3))
    flipped = tmp_path / "flipped.npz"
    with zipfile.ZipFile(saved["path"]) as zin, zipfile.ZipFile(flipped, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.startswith("v0"):
                data = data[:-1] + bytes([data[-1] ^ 1])
            zout.writestr(item, data)
    tu.fork(2)
    try:
        step, probe, pr, X_s, params = build()
        before = [p.get_value() for p in params]
        for bad, match in ((truncated, "not a readable checkpoint"), (foreign, "not a synkhronos checkpoint"),
                           (flipped, "fails its checksum")):
            with pytest.raises(synk.CheckpointError, match=match):
                synk.load(str(bad))
        for p, v in zip(params, before):
            np.testing.assert_array_equal(p.get_value(), v)
        with pytest.raises(TypeError, match="JSON"):
            synk.save(str(tmp_path / "x.npz"), state={"f": object()})
    finally:
        synk.close()
    tu.fork(2)
    try:
        build(width=5)                                  # another model: W is 4x5
        with pytest.raises(synk.CheckpointError, match=r"saved shape \(15,\), this session.s flat_grad_s has "
                           r"shape \(25,\) \(not a checkpoint of this model\)"):
            synk.load(saved["path"])
    finally:
        synk.close()


def test_numba_checkpoint_resumes_on_jax_ranks_and_back(saved, tmp_path):
    """A checkpoint written by numba CPU ranks loads into JAX ranks (the device the values
    live on is not part of the file) and the run continues to rounding; what the JAX ranks
    save loads into numba ranks again."""
    pytest.importorskip("jax")
    back = str(tmp_path / "from_jax.npz")
    synk.fork(2, mode="JAX", use_gpu=False)
    try:
        step, probe, pr, X_s, params = build()
        synk.load(saved["path"])
        np.testing.assert_array_equal(synk.gather(pr), [[1.0, 1.0], [2.0, 2.0]])
        np.testing.assert_allclose(steps(step), saved["after"], rtol=1e-12)
        synk.save(back)
        on_jax = [np.array(p.get_value()) for p in params]
    finally:
        synk.close()
    tu.fork(2)
    try:
        step, probe, pr, X_s, params = build()
        synk.load(back)
        for p, v in zip(params, on_jax):
            np.testing.assert_array_equal(p.get_value(), v)
        assert synk.get_lengths(X_s) == [5, 5]
    finally:
        synk.close()


def test_demo_resumes_at_another_size(tmp_path):
    """demos/mnist_mlp.py: one epoch at 2 ranks with --checkpoint, then --resume at 1 rank
    for the second epoch: its parameters end where the uninterrupted serial run's do."""
    import re
    import subprocess
    import sys
    pytest.importorskip("sklearn")
    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demos", "mnist_mlp.py")
    common = ["--max-steps", "3", "--hidden", "64", "--no-progress", "--checkpoint", str(tmp_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SYNK_MODE", None)
    outs = []
    for extra in (["--n-parallel", "2", "--epochs", "1"], ["--n-parallel", "1", "--epochs", "2", "--resume"]):
        p = subprocess.run([sys.executable, demo, *common, *extra], capture_output=True, text=True, timeout=300,
                           env=env)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        outs.append(p.stdout)
    assert "resumed from" in outs[1] and "1 epoch done (saved at 2 rank(s))" in outs[1], outs[1]
    assert "epoch   1/2" not in outs[1] and "epoch   2/2" in outs[1], outs[1]
    m = re.search(r"synk vs serial after [0-9]+ steps: .* max \|param difference\| ([0-9.e+-]+)", outs[1])
    assert m and float(m.group(1)) < 1e-4, outs[1]


def test_sharded_state_resumes_at_other_world_sizes(tmp_path):
    """Saved at 2 ranks after 2 steps; 3 more steps there are the reference; loaded at 3
    ranks (blocks 29/29/29) and at 1, the same 3 steps continue it to float32 rounding."""
    from test_sharded_updates import BATCH, blocks, build_steps
    from test_updates import ATOL, RTOL, make_data
    path = str(tmp_path / "sharded.npz")
    X, Y = make_data(BATCH, seed=4)
    tu.fork(2)
    try:
        step = build_steps(["adam"], "_ck")["adam"]
        synk.distribute()
        for _ in range(2):
            step(X, Y)
        synk.save(path)
        ref = [float(step(X, Y)) for _ in range(3)]
        ref_params = [p.get_value() for p in step.params]
    finally:
        synk.close()
    for n in (3, 1):
        tu.fork(n)
        try:
            step = build_steps(["adam"], "_ck")["adam"]
            synk.distribute()
            synk.load(path)
            for v in step.sharded_vars:
                assert synk.get_lengths(v) == blocks(n)
            got = [float(step(X, Y)) for _ in range(3)]
            np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=f"at {n} ranks")
            for p, want in zip(step.params, ref_params):
                np.testing.assert_allclose(p.get_value(), want, rtol=RTOL, atol=ATOL)
        finally:
            synk.close()


def _noisy():
    """A function whose output is 3 numbers drawn by each rank's own generator (gathered in
    rank order), the generator advancing at every call."""
    rng = pytensor.shared(np.random.default_rng(11), name="rng")
    r_next, noise = T.random.normal(0, 1, size=(3,), rng=rng, return_next_rng=True)
    f = synk.function([], (noise, "gather"), updates=[(rng, r_next)])
    synk.distribute()
    return f


def test_random_generators_continue_their_streams(tmp_path):
    """Each rank's generator is saved (its state, per rank); loaded at 2 ranks every rank
    draws what it drew after the save; at 3 ranks ranks 0 and 1 do, rank 2 draws a new
    stream of its own (the same at every load); a damaged state changes nothing."""
    path = str(tmp_path / "rng.npz")
    tu.fork(2)
    try:
        f = _noisy()
        f()
        synk.save(path)
        after = [f().reshape(2, 3) for _ in range(2)]
    finally:
        synk.close()
    man = json.loads(np.load(path)["__manifest__"].tobytes().decode())
    assert [e["name"] for e in man["random"]] == ["rng"] and len(man["random"][0]["states"]) == 2
    tu.fork(2)
    try:
        f = _noisy()
        synk.load(path)
        for want in after:
            np.testing.assert_array_equal(f().reshape(2, 3), want)
    finally:
        synk.close()
    firsts = []
    for _ in range(2):
        tu.fork(3)
        try:
            f = _noisy()
            synk.load(path)
            got = f().reshape(3, 3)
            np.testing.assert_array_equal(got[:2], after[0])
            assert not np.allclose(got[2], got[0]) and not np.allclose(got[2], got[1])
            firsts.append(got[2])
        finally:
            synk.close()
    np.testing.assert_array_equal(firsts[0], firsts[1])


def test_damaged_random_state_changes_nothing(tmp_path):
    path, bad = str(tmp_path / "rng.npz"), str(tmp_path / "bad.npz")
    tu.fork(2)
    try:
        f = _noisy()
        synk.save(path)
        z = dict(np.load(path))
        man = json.loads(z["__manifest__"].tobytes().decode())
        man["random"][0]["states"][1]["bit_generator"] = "NoSuchGenerator"
        z["__manifest__"] = np.frombuffer(json.dumps(man).encode(), np.uint8)
        np.savez(bad, **z)
        before = f().reshape(2, 3)
        synk.load(path)                       # back to the saved streams
        with pytest.raises(synk.CheckpointError, match="random generator"):
            synk.load(bad)
        np.testing.assert_array_equal(f().reshape(2, 3), before)   # nothing was changed
    finally:
        synk.close()


def test_ctrl_c_during_load_sets_everything_or_nothing(tmp_path):
    """SIGINT at 24 moments across a load of replicated and per-rank variables (16 MB):
    afterwards every variable on every rank holds either its value before the load or the
    file's, never a mix, and the session goes on working."""
    path = str(tmp_path / "big.npz")
    tu.fork(2)
    try:
        vs = [pytensor.shared(np.full(250_000, float(i)), name=f"v{i}") for i in range(8)]
        f = synk.function([], T.add(*[v.sum() for v in vs]), updates=[(v, v + 1.0) for v in vs])
        synk.distribute()
        for v in vs[::2]:                                       # per-rank: set rank by rank
            synk.set_value(1, v, -v.get_value())
        saved = [synk.gather(v) for v in vs]
        synk.save(path)
        f()                                                     # now every value is saved + 1
        t0 = time.perf_counter()
        synk.load(path)
        took = time.perf_counter() - t0
        f()
        outcomes = set()
        for delay in np.linspace(0.0, 1.3 * took, 24):
            timer = threading.Timer(delay, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
            try:
                timer.start()
                synk.load(path)
                timer.join()
            except KeyboardInterrupt:
                timer.join()
            now = [synk.gather(v) for v in vs]
            loaded = [np.array_equal(a, b) for a, b in zip(now, saved)]
            kept = [np.array_equal(a, b + 1.0) for a, b in zip(now, saved)]
            assert all(loaded) or all(kept), (delay, loaded, kept)
            outcomes.add(all(loaded))
            if all(loaded):
                f()
        assert np.isfinite(f()) and outcomes == {True, False}, outcomes
    finally:
        synk.close()
