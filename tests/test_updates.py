"""synkhronos.extensions.updates / train: data-parallel training tracks serial training.

One synkhronos session (2 ranks) for the whole module: every rule gets its own parameters
(and so its own two functions), all built before a single ``distribute()``.  The reference
is independent of PyTensor: the same 2-layer MLP, its gradients and Lasagne's update
formulas written in numpy (float64).  The batch (8 rows) splits evenly over the 2 ranks, so
averaging the ranks' gradients is exactly the full-batch gradient.

The original Synkhronos' spellings are checked too: ``nonflat_grads``/``sgd_nonflat``, its
keyword names (``loss``, ``variables``, ``param_updates``) next to ours/Lasagne's, and
``make_train_function(loss, params, x, y, update_rule, ...)``."""
import inspect

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import equal_computations

try:
    from pytensor.graph.traversal import ancestors
except ImportError:  # older PyTensor
    from pytensor.graph.basic import ancestors

import synkhronos as synk
import synk_testutil as tu
from synkhronos.extensions import train, updates

N_IN, N_HID, N_OUT, BATCH, STEPS = 10, 6, 3, 8, 3
ATOL, RTOL = 2e-5, 2e-4

# rule name -> hyperparameters given (others are the defaults, checked below too)
RULES = {
    "sgd": dict(learning_rate=0.1),
    "momentum": dict(learning_rate=0.1, momentum=0.8),
    "nesterov_momentum": dict(learning_rate=0.1),
    "adagrad": dict(learning_rate=0.1),
    "rmsprop": dict(learning_rate=0.01),
    "adadelta": dict(),
    "adam": dict(),
    "adamax": dict(learning_rate=0.01),
}

LASAGNE_DEFAULTS = {
    "momentum": dict(momentum=0.9),
    "nesterov_momentum": dict(momentum=0.9),
    "adagrad": dict(learning_rate=1.0, epsilon=1e-6),
    "rmsprop": dict(learning_rate=1.0, rho=0.9, epsilon=1e-6),
    "adadelta": dict(learning_rate=1.0, rho=0.95, epsilon=1e-6),
    "adam": dict(learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8),
    "adamax": dict(learning_rate=0.002, beta1=0.9, beta2=0.999, epsilon=1e-8),
}


# ------------------------------------------------------------------------------------------
# numpy reference


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(N_IN, N_HID)) * 0.5).astype(np.float32),
            (rng.normal(size=N_HID) * 0.1).astype(np.float32),
            (rng.normal(size=(N_HID, N_OUT)) * 0.5).astype(np.float32),
            (rng.normal(size=N_OUT) * 0.1).astype(np.float32)]


def make_data(rows, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, N_IN)).astype(np.float32), rng.integers(0, N_OUT, rows).astype(np.int32)


def np_loss_grads(params, X, Y):
    W1, b1, W2, b2 = params
    X = X.astype(np.float64)
    h = np.tanh(X @ W1 + b1)
    z = h @ W2 + b2
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    n = len(X)
    loss = -logp[np.arange(n), Y].mean()
    dz = np.exp(logp)
    dz[np.arange(n), Y] -= 1
    dz /= n
    dh = (dz @ W2.T) * (1 - h ** 2)
    return loss, [X.T @ dh, dh.sum(0), h.T @ dz, dz.sum(0)]


class NumpyRule:
    """Lasagne's formulas, float64."""

    def __init__(self, name, **kw):
        self.name = name
        self.hp = dict(LASAGNE_DEFAULTS.get(name, {}), **kw)
        self.state = {}
        self.t = 0

    def _s(self, key, i, like):
        return self.state.setdefault((key, i), np.zeros_like(like))

    def step(self, params, grads):
        hp, name = self.hp, self.name
        self.t += 1
        t = self.t
        out = []
        for i, (p, g) in enumerate(zip(params, grads)):
            lr = hp.get("learning_rate")
            if name == "sgd":
                new = p - lr * g
            elif name == "momentum":
                v = self._s("v", i, p)
                x = hp["momentum"] * v + (p - lr * g)
                self.state[("v", i)] = x - p
                new = x
            elif name == "nesterov_momentum":
                v = self._s("v", i, p)
                upd = p - lr * g
                x = hp["momentum"] * v + upd - p
                self.state[("v", i)] = x
                new = hp["momentum"] * x + upd
            elif name == "adagrad":
                a = self._s("a", i, p) + g ** 2
                self.state[("a", i)] = a
                new = p - lr * g / np.sqrt(a + hp["epsilon"])
            elif name == "rmsprop":
                a = hp["rho"] * self._s("a", i, p) + (1 - hp["rho"]) * g ** 2
                self.state[("a", i)] = a
                new = p - lr * g / np.sqrt(a + hp["epsilon"])
            elif name == "adadelta":
                rho, eps = hp["rho"], hp["epsilon"]
                a = rho * self._s("a", i, p) + (1 - rho) * g ** 2
                d = self._s("d", i, p)
                upd = g * np.sqrt(d + eps) / np.sqrt(a + eps)
                self.state[("a", i)] = a
                self.state[("d", i)] = rho * d + (1 - rho) * upd ** 2
                new = p - lr * upd
            elif name == "adam":
                b1, b2, eps = hp["beta1"], hp["beta2"], hp["epsilon"]
                a_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                m = b1 * self._s("m", i, p) + (1 - b1) * g
                v = b2 * self._s("v", i, p) + (1 - b2) * g ** 2
                self.state[("m", i)], self.state[("v", i)] = m, v
                new = p - a_t * m / (np.sqrt(v) + eps)
            elif name == "adamax":
                b1, b2, eps = hp["beta1"], hp["beta2"], hp["epsilon"]
                a_t = lr / (1 - b1 ** t)
                m = b1 * self._s("m", i, p) + (1 - b1) * g
                u = np.maximum(b2 * self._s("u", i, p), np.abs(g))
                self.state[("m", i)], self.state[("u", i)] = m, u
                new = p - a_t * m / (u + eps)
            else:
                raise AssertionError(name)
            out.append(new)
        return out


# ------------------------------------------------------------------------------------------
# the synkhronos session


def build_model(x, y, tag):
    params = [pytensor.shared(v, name=f"{tag}_{n}") for v, n in zip(init_params(), ("W1", "b1", "W2", "b2"))]
    W1, b1, W2, b2 = params
    h = pt.tanh(x @ W1 + b1)
    logp = pt.special.log_softmax(h @ W2 + b2, axis=-1)
    loss = -pt.mean(logp[pt.arange(y.shape[0]), y])
    return loss, params


@pytest.fixture(scope="module")
def session():
    tu.fork(2)
    try:
        x = pt.matrix("x", dtype="float32")
        y = pt.ivector("y")
        steps = {}
        for name, hp in RULES.items():
            loss, params = build_model(x, y, name)
            steps[name] = train.make_train_function(loss, params, [x, y], getattr(updates, name), **hp)
        # extra sessions: serial path only; index batch + slices; snapshot/restore
        loss, params = build_model(x, y, "serial")
        steps["serial"] = train.make_train_function(loss, params, [x, y], updates.adam)
        loss, params = build_model(x, y, "uneven")
        steps["uneven"] = train.make_train_function(loss, params, [x, y], updates.adam)
        loss, params = build_model(x, y, "sliced")
        steps["sliced"] = train.make_train_function(loss, params, [x, y], updates.momentum,
                                                    learning_rate=0.1)
        # the original's forms: (loss, params, x, y, update_rule, *args), and keywords
        loss, params = build_model(x, y, "nonflat_old")
        steps["nonflat_old"] = train.make_train_function(loss, params, x, y, updates.sgd_nonflat, 0.1)
        loss, params = build_model(x, y, "old_kw")
        steps["old_kw"] = train.make_train_function(loss, params, x=x, y=y,
                                                    update_rule=updates.nesterov_momentum,
                                                    learning_rate=0.1)
        synk.distribute()
        yield steps
    finally:
        synk.close()


def check_params(step, ref_params, all_ranks=True):
    for var, ref in zip(step.params, ref_params):
        got = var.get_value()
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL, err_msg=var.name)
        if all_ranks:
            per_rank = synk.gather(var)
            for r in range(1, len(per_rank)):
                np.testing.assert_array_equal(per_rank[r], per_rank[0], err_msg=f"{var.name} rank {r}")


@pytest.mark.parametrize("name", list(RULES))
def test_rule_tracks_serial(session, name):
    step = session[name]
    X, Y = make_data(BATCH)
    xd, yd = synk.data(X), synk.data(Y)
    ref = [p.astype(np.float64) for p in init_params()]
    rule = NumpyRule(name, **RULES[name])
    for k in range(STEPS):
        loss = step(xd, yd)
        ref_loss, grads = np_loss_grads(ref, X, Y)
        # the flat gradient after the all-reduce is the full-batch gradient
        np.testing.assert_allclose(step.grad_shared.get_value(),
                                   np.concatenate([g.ravel() for g in grads]), rtol=RTOL, atol=ATOL)
        ref = rule.step(ref, grads)
        assert np.ndim(loss) == 0
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=f"step {k}")
        check_params(step, ref)


def test_serial_path_matches_reference(session):
    step = session["serial"]
    X, Y = make_data(BATCH, seed=2)
    ref = [p.astype(np.float64) for p in init_params()]
    rule = NumpyRule("adam")
    for _ in range(STEPS):
        loss = step.serial(X, Y)
        ref_loss, grads = np_loss_grads(ref, X, Y)
        ref = rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        check_params(step, ref, all_ranks=False)


def test_index_batch_with_slices_and_restore(session):
    step = session["sliced"]
    X, Y = make_data(20, seed=3)
    xd, yd = synk.data(X), synk.data(Y)
    idx = np.array([17, 3, 0, 9, 12, 5, 19, 8])
    snap = step.snapshot()
    ref = [p.astype(np.float64) for p in init_params()]
    rule = NumpyRule("momentum", learning_rate=0.1)
    for _ in range(2):
        loss = step(xd, yd, batch=idx, num_slices=2)
        ref_loss, grads = np_loss_grads(ref, X[idx], Y[idx])
        ref = rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        check_params(step, ref)
    step.restore(snap)
    for var, val in zip(step.state_vars, snap):
        for r, got in enumerate(synk.gather(var)):
            np.testing.assert_array_equal(got, val, err_msg=f"{var.name} rank {r}")
    # restored state (incl. velocities) gives the first step again
    loss = step(xd, yd, batch=idx)
    first_loss, grads = np_loss_grads([p.astype(np.float64) for p in init_params()], X[idx], Y[idx])
    np.testing.assert_allclose(loss, first_loss, rtol=1e-5)
    check_params(step, NumpyRule("momentum", learning_rate=0.1).step(
        [p.astype(np.float64) for p in init_params()], grads))


def test_uneven_and_empty_shards_track_serial(session):
    """Batches that split unevenly over the ranks or leave one without rows (5, 1, 3, 1 and
    7 rows on 2 ranks, with slices): the all-reduced gradient is the whole batch's, on every
    rank, as in serial training.  (Each rank's mean gradient was averaged with equal
    weights: one row gave half the gradient, and the rank without rows added its previous
    gradient.)"""
    step = session["uneven"]
    X, Y = make_data(20, seed=4)
    ref = [p.astype(np.float64) for p in init_params()]
    rule = NumpyRule("adam")
    for rows, slices in ((5, 1), (1, 1), (3, 2), (1, 1), (7, 3)):
        loss = step(X[:rows], Y[:rows], num_slices=slices)
        ref_loss, grads = np_loss_grads(ref, X[:rows], Y[:rows])
        flat = np.concatenate([g.ravel() for g in grads])
        for r, got in enumerate(synk.gather(step.grad_shared, nd_up=1)):
            np.testing.assert_allclose(got, flat, rtol=RTOL, atol=ATOL, err_msg=f"{rows} rows: rank {r}")
        ref = rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=f"{rows} rows")
        check_params(step, ref)


# ------------------------------------------------------------------------------------------
# graph-level checks (no compilation)


@pytest.mark.parametrize("name", list(LASAGNE_DEFAULTS))
def test_lasagne_defaults(name):
    sig = inspect.signature(getattr(updates, name))
    for k, v in LASAGNE_DEFAULTS[name].items():
        assert sig.parameters[k].default == v, (name, k)


@pytest.mark.parametrize("name", list(RULES))
def test_one_flat_gradient_and_single_time_step(name):
    x = pt.matrix("x", dtype="float32")
    y = pt.ivector("y")
    loss, params = build_model(x, y, "g")
    grad_updates, param_updates, grad_shared = getattr(updates, name)(loss, params, **RULES[name])
    assert len(grad_updates) == 1 and grad_updates[0][0] is grad_shared
    assert grad_shared.ndim == 1 and grad_shared.dtype == "float32"
    assert grad_shared.get_value().size == sum(p.get_value().size for p in params)
    targets = [v for v, _ in param_updates]
    assert len({id(v) for v in targets}) == len(targets), "a variable is updated twice"
    for p in params:
        assert any(v is p for v in targets)
    for v, e in param_updates:
        assert e.dtype == v.dtype, (v, e)
    if name in ("adam", "adamax"):
        assert sum(v.name == "t_prev" for v in targets) == 1


def test_apply_momentum_forms():
    p = pytensor.shared(np.ones(3, np.float32), name="p")
    q = pytensor.shared(np.ones(2, np.float32), name="q")
    ups = [(p, p - 1), (q, q * 2)]
    for fn in (updates.apply_momentum, updates.apply_nesterov_momentum):
        a = fn(ups)                                   # Lasagne: every updated param
        assert len(a) == 4 and a[0][0] is p and a[1][0] is q
        b = fn(dict(ups), [p], momentum=0.5)          # only p
        assert len(b) == 3
        c = fn(ups, 0.5)                              # original synkhronos: (updates, momentum)
        assert len(c) == 4


def test_bad_params():
    x = pt.vector("x", dtype="float32")
    with pytest.raises(ValueError, match="empty"):
        updates.sgd(x.sum(), [], 0.1)
    with pytest.raises(TypeError, match="shared"):
        updates.sgd(x.sum(), [x], 0.1)


def test_gradients_instead_of_loss():
    x = pt.matrix("x", dtype="float32")
    y = pt.ivector("y")
    loss, params = build_model(x, y, "lg")
    grads = pytensor.grad(loss, params)
    grad_updates, param_updates, grad_shared = updates.adam(grads, params)
    assert grad_shared.get_value().size == sum(p.get_value().size for p in params)
    assert len(param_updates) == 3 * len(params) + 1
    with pytest.raises(ValueError, match="gradients"):
        updates.sgd(grads[:2], params, 0.1)


# ------------------------------------------------------------------------------------------
# the original Synkhronos' names and call forms


def test_sgd_nonflat_original_positional_form(session):
    """make_train_function(loss, params, x, y, updates.sgd_nonflat, lr): one gradient shared
    variable per parameter, all-reduced as a list; tracks float64 SGD on every rank."""
    step = session["nonflat_old"]
    assert isinstance(step.grad_shared, list) and len(step.grad_shared) == len(step.params)
    assert [v.name for v in step.inputs] == ["x", "y"]
    X, Y = make_data(BATCH, seed=4)
    xd, yd = synk.data(X), synk.data(Y)
    ref = [p.astype(np.float64) for p in init_params()]
    rule = NumpyRule("sgd", learning_rate=0.1)
    for k in range(STEPS):
        # the original step was train_minibatch(x_data, y_data, batch=None)
        loss = step(xd, yd) if k % 2 == 0 else step(x_data=xd, y_data=yd, batch=None)
        ref_loss, grads = np_loss_grads(ref, X, Y)
        for g_s, g in zip(step.grad_shared, grads):
            assert g_s.get_value().shape == g.shape
            np.testing.assert_allclose(g_s.get_value(), g, rtol=RTOL, atol=ATOL, err_msg=g_s.name)
            per_rank = synk.gather(g_s)           # all-reduced: the same on every rank
            np.testing.assert_array_equal(per_rank[1], per_rank[0])
        ref = rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=f"step {k}")
        check_params(step, ref)


def test_original_keyword_form(session):
    """make_train_function(loss, params, x=x, y=y, update_rule=..., **hyperparameters)."""
    step = session["old_kw"]
    X, Y = make_data(BATCH, seed=5)
    xd, yd = synk.data(X), synk.data(Y)
    ref = [p.astype(np.float64) for p in init_params()]
    rule = NumpyRule("nesterov_momentum", learning_rate=0.1)
    for _ in range(STEPS):
        loss = step(x_data=xd, y_data=yd)
        ref_loss, grads = np_loss_grads(ref, X, Y)
        ref = rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        check_params(step, ref)
    with pytest.raises(TypeError, match="twice"):
        step(xd, x_data=xd)


def test_make_train_function_theano_both_forms():
    """The original's single-process builder: no synkhronos session involved."""
    x = pt.matrix("x", dtype="float32")
    y = pt.ivector("y")
    X, Y = make_data(BATCH, seed=6)
    loss, params = build_model(x, y, "th_old")
    old = train.make_train_function_theano(loss, params, x, y, updates.rmsprop, 0.01)
    loss, params = build_model(x, y, "th_new")
    new = train.make_train_function_theano(loss, params, [x, y], updates.sgd_nonflat,
                                           learning_rate=0.1)
    for step, rule in ((old, NumpyRule("rmsprop", learning_rate=0.01)),
                       (new, NumpyRule("sgd", learning_rate=0.1))):
        ref = [p.astype(np.float64) for p in init_params()]
        for k in range(STEPS):
            loss_value = step(X, Y) if k % 2 == 0 else step(x_data=X, y_data=Y)
            ref_loss, grads = np_loss_grads(ref, X, Y)
            ref = rule.step(ref, grads)
            np.testing.assert_allclose(loss_value, ref_loss, rtol=1e-5)
            for var, r in zip(step.params, ref):
                np.testing.assert_allclose(var.get_value(), r, rtol=RTOL, atol=ATOL, err_msg=var.name)


def test_train_call_forms_and_errors():
    """Both forms are told apart without ambiguity; a wrong call shows the right one.
    (No compilation: every case here fails before synk.function is reached, or is parsed
    by the helper alone.)"""
    x = pt.matrix("x", dtype="float32")
    y = pt.ivector("y")
    lr = pt.scalar("lr", dtype="float32")
    parse = train._parse_form
    sgd = updates.sgd
    assert parse("f", [x, y], (sgd, 0.1), None, None, None) == ([x, y], sgd, [0.1])
    assert parse("f", x, (y, sgd, 0.1), None, None, None) == ([x, y], sgd, [0.1])
    assert parse("f", x, (y, sgd, lr), None, None, None) == ([x, y], sgd, [lr])
    assert parse("f", x, (y,), sgd, None, None) == ([x, y], sgd, [])
    assert parse("f", x, (), sgd, None, y) == ([x, y], sgd, [])
    assert parse("f", None, (), sgd, x, y) == ([x, y], sgd, [])
    assert parse("f", (x, y), (), sgd, None, None) == ([x, y], sgd, [])
    assert parse("f", x, (sgd, lr), None, None, None) == ([x], sgd, [lr])   # one input
    loss, params = build_model(x, y, "err")
    for fn in (train.make_train_function, train.make_train_function_theano):
        name = fn.__name__
        new_call = rf"{name}\(loss, params, \[x, y\], updates.sgd"
        with pytest.raises(TypeError, match=new_call):
            fn(loss, params, x, y)                               # no update rule
        with pytest.raises(TypeError, match=new_call):
            fn(loss, params, [x, y], x, updates.sgd)             # a variable as update rule
        with pytest.raises(TypeError, match=new_call):
            fn(loss, params, [x, y])
        with pytest.raises(TypeError, match=new_call):
            fn(loss, params, "x", updates.sgd)
        with pytest.raises(TypeError, match=new_call):
            fn(loss, params, x=x, update_rule=updates.sgd)       # y missing


def test_nonflat_grads():
    x = pt.matrix("x", dtype="float32")
    y = pt.ivector("y")
    loss, params = build_model(x, y, "nf")
    for call in (lambda: updates.nonflat_grads(loss, params),
                 lambda: updates.nonflat_grads(loss=loss, params=params),
                 lambda: updates.nonflat_grads(loss_or_grads=loss, params=params)):
        grads_shared, grads = call()
        assert len(grads_shared) == len(grads) == len(params)
        for g_s, g, p in zip(grads_shared, grads, params):
            val = g_s.get_value()
            assert val.shape == p.get_value().shape and val.dtype == np.float32 and not val.any()
            assert g_s.type.shape == p.type.shape and g_s.name == f"{p.name}_grad"
            assert g.dtype == p.dtype
        assert equal_computations(grads, pytensor.grad(loss, params))
    grads = pytensor.grad(loss, params)
    g_s, g2 = updates.nonflat_grads(grads, params)         # gradients instead of the loss
    assert all(a is b for a, b in zip(g2, grads))


def test_sgd_nonflat_structure():
    x = pt.matrix("x", dtype="float32")
    y = pt.ivector("y")
    loss, params = build_model(x, y, "snf")
    grad_updates, param_updates, grads_shared = updates.sgd_nonflat(loss, params, 0.1)
    assert isinstance(grads_shared, list) and len(grads_shared) == len(params)
    assert all(a is b for (a, _), b in zip(grad_updates, grads_shared))
    assert equal_computations([g for _, g in grad_updates], pytensor.grad(loss, params))
    assert all(a is b for (a, _), b in zip(param_updates, params))
    for (p, e), g_s in zip(param_updates, grads_shared):
        assert e.dtype == p.dtype
        assert any(v is g_s for v in ancestors([e]))          # reads the all-reduced grad
        assert not any(v is x for v in ancestors([e]))        # not the raw gradient
    a = updates.sgd_nonflat(loss_or_grads=loss, params=params, learning_rate=0.1)
    assert len(a[0]) == len(a[1]) == len(params)


# name -> the original Synkhronos' parameters, in order ((name, default) or name)
ORIGINAL_SIGNATURES = {
    "flatten_vars": ["variables"],
    "vars_flat_size": ["variables"],
    "unflatten_vars": ["flat_var", "variables"],
    "flat_unflat_grads": ["loss", "params"],
    "nonflat_grads": ["loss", "params"],
    "sgd": ["loss", "params", "learning_rate"],
    "sgd_nonflat": ["loss", "params", "learning_rate"],
    "momentum": ["loss", "params", "learning_rate", ("momentum", 0.9)],
    "nesterov_momentum": ["loss", "params", "learning_rate", ("momentum", 0.9)],
    "adagrad": ["loss", "params", ("learning_rate", 1.0), ("epsilon", 1e-6)],
    "rmsprop": ["loss", "params", ("learning_rate", 1.0), ("rho", 0.9), ("epsilon", 1e-6)],
    "adadelta": ["loss", "params", ("learning_rate", 1.0), ("rho", 0.95), ("epsilon", 1e-6)],
    "adam": ["loss", "params", ("learning_rate", 0.001), ("beta1", 0.9), ("beta2", 0.999),
             ("epsilon", 1e-8)],
    "adamax": ["loss", "params", ("learning_rate", 0.002), ("beta1", 0.9), ("beta2", 0.999),
               ("epsilon", 1e-8)],
    # (param_updates, momentum=0.9): the name is an alias, the second place is checked in
    # test_apply_momentum_original_forms (ours is Lasagne's (updates, params=None, momentum))
    "apply_momentum": ["param_updates"],
    "apply_nesterov_momentum": ["param_updates"],
}


@pytest.mark.parametrize("name", list(ORIGINAL_SIGNATURES))
def test_original_signatures(name):
    fn = getattr(updates, name)
    assert name in updates.__all__
    ours = list(inspect.signature(fn).parameters.values())
    aliases = getattr(fn, "keyword_aliases", {})
    for i, spec in enumerate(ORIGINAL_SIGNATURES[name]):
        pname, default = (spec, inspect.Parameter.empty) if isinstance(spec, str) else spec
        ours_p = ours[i]
        assert ours_p.kind in (ours_p.POSITIONAL_OR_KEYWORD, ours_p.POSITIONAL_ONLY)
        assert pname == ours_p.name or aliases.get(pname) == ours_p.name, (name, pname, ours_p.name)
        assert ours_p.default == default, (name, pname)
    # any further parameter of ours is optional
    assert all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in ours[len(ORIGINAL_SIGNATURES[name]):])


def test_keyword_spellings():
    x = pt.matrix("x", dtype="float32")
    y = pt.ivector("y")
    loss, params = build_model(x, y, "kw")
    flat = pt.vector("flat", dtype="float32")
    a = updates.unflatten_vars(flat, variables=params)
    b = updates.unflatten_vars(flat, like=params)
    c = updates.unflatten_vars(flat_var=flat, variables=params)
    assert equal_computations(a, b) and equal_computations(a, c)
    assert [v.type.ndim for v in a] == [2, 1, 2, 1]
    g1 = updates.flat_unflat_grads(loss=loss, params=params)
    g2 = updates.flat_unflat_grads(loss_or_grads=loss, params=params)
    g3 = updates.flat_unflat_grads(loss, params)
    for g in (g1, g2, g3):
        assert g[0].name == "flat_grad_s" and g[0].get_value().shape == (N_IN * N_HID + N_HID + N_HID * N_OUT + N_OUT,)
    assert equal_computations([g1[1]], [g2[1]]) and equal_computations([g1[1]], [g3[1]])
    for name, hp in RULES.items():
        n1 = len(getattr(updates, name)(loss=loss, params=params, **hp)[1])
        n2 = len(getattr(updates, name)(loss_or_grads=loss, params=params, **hp)[1])
        assert n1 == n2 == len(getattr(updates, name)(loss, params, **hp)[1])
    # one argument given under both names, or by position and by alias: TypeError
    with pytest.raises(TypeError, match="twice"):
        updates.unflatten_vars(flat, variables=params, like=params)
    with pytest.raises(TypeError, match="twice"):
        updates.flat_unflat_grads(loss, params, loss_or_grads=loss)
    with pytest.raises(TypeError, match="twice"):
        updates.sgd(loss, params, 0.1, loss_or_grads=loss)
    with pytest.raises(TypeError, match="twice"):
        updates.unflatten_vars(flat, params, like=params)


def _same_updates(u1, u2):
    """Equal update lists up to their own (fresh) state variables."""
    assert len(u1) == len(u2)
    shared_1 = [v for v, _ in u1]
    shared_2 = [v for v, _ in u2]
    return equal_computations([e for _, e in u1], [e for _, e in u2], in_xs=shared_1, in_ys=shared_2)


def test_apply_momentum_original_forms():
    p = pytensor.shared(np.ones(3, np.float32), name="p")
    q = pytensor.shared(np.ones(2, np.float32), name="q")
    ups = [(p, p - 1), (q, q * 2)]
    for fn in (updates.apply_momentum, updates.apply_nesterov_momentum):
        ref = fn(ups, momentum=0.5)
        assert _same_updates(ref, fn(param_updates=ups, momentum=0.5))   # original keyword
        assert _same_updates(ref, fn(updates=ups, momentum=0.5))         # ours / Lasagne's
        assert _same_updates(ref, fn(ups, 0.5))                          # original positional
        assert _same_updates(ref, fn(ups, None, 0.5))                    # Lasagne positional
        assert _same_updates(fn(ups), fn(param_updates=ups, momentum=0.9))
        assert not _same_updates(ref, fn(ups))
        with pytest.raises(TypeError, match="twice"):
            fn(ups, 0.5, momentum=0.7)
        with pytest.raises(TypeError, match="twice"):
            fn(ups, param_updates=ups)
        with pytest.raises(TypeError, match="twice"):
            fn(updates=ups, param_updates=ups)
    # a 0-d shared momentum in the original's second place (not an updated variable)
    m = pytensor.shared(np.float32(0.5), name="m")
    new = updates.apply_momentum(ups, m)
    assert _same_updates(new, updates.apply_momentum(ups, momentum=m))
    f = pytensor.function([], [], updates=new, mode="FAST_COMPILE")
    f()
    f()
    # x = m v + (p - 1): p 1 -> 0 (v = -1) -> 0.5 * -1 + (0 - 1) = -1.5
    np.testing.assert_allclose(p.get_value(), -1.5)
