"""The fault scenarios of the multi-host tests (run through ``_mpi_scripts.py SCENARIO
ARGS`` under ``mpiexec``): a rank lost, frozen or raising on another host, an interrupt, a
broadcast root lost, the parameter server and its lost workers, checkpoints and elastic
runs."""
import os
import signal
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fault_scripts import _info, _result  # noqa: E402  (one emitter for every script)
from _mpi_common import _session  # noqa: E402


def scenario_fault(n, what):
    """``kill`` / ``stop``: the last rank (on the last host) is killed / stopped while the
    master waits for it; ``raise``: the master's script raises an uncaught exception;
    ``idle``: the master just waits (to be killed from outside); ``fork_error``: the
    master's ``synk.fork(n)`` is refused (an uncaught ValueError)."""
    import pytensor.tensor as T
    import synkhronos as synk
    if what == "fork_error":
        synk.fork(int(n))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _fault_ops as fo
    fo.quiet()
    info = _session(n)
    x = T.vector("x", dtype="float64")
    f = synk.function([x], (T.sum(fo.Fault("sleep")(x)), "sum"))
    synk.distribute()
    assert f(np.arange(float(info.n))) == sum(range(info.n))
    if what == "raise":
        raise RuntimeError("synk-test: an uncaught exception in the master")
    if what == "idle":
        _info(ready=True)
        time.sleep(120)
        return
    data = np.arange(float(info.n))
    data[-1] = fo.TRIGGER                  # the victim's share sleeps: the call surely waits
    res = {}
    _lose_rank(info.ranks[-1], what, 0.5, lambda: f(data), res)
    synk.close()
    _result(**res)


def scenario_close_lost(n, what="kill"):
    """``synk.close()`` while the last rank (on the other host) is frozen, and killed 0.5 s
    later (``kill``) or left frozen (``stop``): the other rank of its host has answered
    "quit" and exited by then.  How long the close took (its limit for the ranks' answers is
    5 s) and whether it raised."""
    import synkhronos as synk
    info = _session(n)
    victim = info.ranks[-1]
    os.kill(victim.pid, signal.SIGSTOP)
    if what == "kill":
        threading.Timer(0.5, lambda: os.kill(victim.pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    raised = None
    try:
        synk.close()
    except Exception as e:
        raised = repr(e)
    _result(seconds=time.monotonic() - t0, raised=raised, open_after=synk.session_info() is not None,
            victim=victim.rank, victim_host=victim.host)


def _faulty_step(n, action, interrupt=None):
    """One step of a linear model (``w``) whose last rank's gradient, on a marked row,
    does ``action`` (``fo.Fault``: "raise" or "sleep") before the step's all-reduce between
    groups or hosts, after one good step; ``interrupt``: Ctrl-C in the master that many
    seconds in.  Returns what the marked step raised, how long it took, whether it left the
    parameters of every rank as they were, and whether the next good step is exact (every
    good step takes the same amount off, the loss being linear in ``w``)."""
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos.extensions import train, updates
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _fault_ops as fo
    fo.quiet()
    n = _session(n).n
    x = T.matrix("x", dtype="float64")
    w = pytensor.shared(np.ones(3), name="w")
    loss = T.sum(fo.Fault(action, rank=n - 1)(x).dot(w))
    step = train.make_train_function(loss, [w], [x], update_rule=updates.sgd, learning_rate=0.01)
    synk.distribute()
    X = np.arange(6.0 * n).reshape(2 * n, 3) / (6.0 * n)
    marked = X.copy()
    marked[-1, 0] = fo.TRIGGER              # in the last rank's rows
    step(X)
    w1 = np.stack(synk.gather(w, nd_up=1))
    if interrupt is not None:
        threading.Timer(interrupt, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t = time.monotonic()
    raised = message = None
    try:
        step(marked)
    except (Exception, KeyboardInterrupt) as e:
        raised, message = type(e).__name__, str(e)[:500]
    seconds = time.monotonic() - t
    after = np.stack(synk.gather(w, nd_up=1))
    step(X)
    w2 = np.stack(synk.gather(w, nd_up=1))
    synk.close()
    return dict(raised=raised, message=message, seconds=seconds, sleep_s=fo.SLEEP_S,
                moved=bool(np.any(w1 != 1.0)), unchanged=bool(np.array_equal(after, w1)),
                ranks_agree=bool(np.all(w1 == w1[0])),
                next_step_right=bool(np.allclose(w2, 2 * w1 - 1.0, rtol=0, atol=1e-12)))


def scenario_step_fails(n):
    """The gradient raises in the last rank (the other host) before the step's all-reduce."""
    _result(**_faulty_step(n, "raise"))


def scenario_ctrl_c_slow(n):
    """Ctrl-C in the master 0.5 s into a step whose last rank (another group or host)
    computes for SLEEP_S seconds before the step's all-reduce."""
    _result(**_faulty_step(n, "sleep", interrupt=0.5))


def _lose_rank(victim, what, after, call, res):
    """``call()`` while rank ``victim`` is killed (``kill``) or frozen (``stop``) ``after``
    seconds in; what it raised goes into ``res`` (and is returned); a frozen rank is then
    resumed."""
    import threading
    import synkhronos as synk
    sig = signal.SIGKILL if what == "kill" else signal.SIGSTOP
    threading.Timer(after, lambda: os.kill(victim.pid, sig)).start()
    t0 = time.monotonic()
    res.update(victim=victim.rank, victim_host=victim.host)
    err = None
    try:
        call()
        res["raised"] = None
    except synk.SynkError as e:
        err = e
        res.update(raised=type(e).__name__, message=str(e), rank=getattr(e, "rank", None),
                   host=getattr(e, "host", None))
    res["seconds"] = time.monotonic() - t0 - after
    res["open_after"] = synk.session_info() is not None
    if what == "stop":
        try:
            os.kill(victim.pid, signal.SIGCONT)
        except OSError:
            pass
    return err


def _eth0():
    """(rx, tx) bytes of this host's eth0 (a simulated host's link to the others), or None."""
    try:
        with open("/proc/self/net/dev") as fh:
            for line in fh:
                if line.strip().startswith("eth0:"):
                    f = line.split(":", 1)[1].split()
                    return int(f[0]), int(f[8])
    except OSError:
        pass
    return None


def scenario_ps(n, what):
    """The asynchronous parameter server across hosts (``ParameterServer.run``; workers of
    the other host exchange through its agent).  ``run``: the last rank (other host) slowed
    by ``straggle``; the loss decreases, every applied gradient is within the staleness
    bound, the counts add up, the others are not stalled, the bytes between the hosts are
    one message per gradient and per answer; Ctrl-C stops a run and runs go on.  ``kill`` /
    ``stop``: the last rank is killed / frozen during a run: the others go on, then ``run``
    raises WorkerDied / WorkerStopped naming it and its host.  ``raise``: the last rank's
    gradient raises (NaN in its rows): the run ends at once with WorkerError naming it,
    every rank holds the server's weights, the session goes on."""
    import threading
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos.extensions import exchange, updates
    info = _session(n)
    n = info.n
    slow_rank, SLOW = n - 1, 0.4
    rng = np.random.default_rng(2)
    NI, H, NO = 32, 2048, 4                          # a 288 KB gradient
    X = rng.standard_normal((512, NI)).astype(np.float32)
    Y = np.argmax(X @ rng.standard_normal((NI, NO)), axis=1).astype(np.int32)
    W1 = pytensor.shared((rng.standard_normal((NI, H)) * 0.05).astype(np.float32), name="W1")
    W2 = pytensor.shared((rng.standard_normal((H, NO)) * 0.05).astype(np.float32), name="W2")
    x, y = T.matrix("x", dtype="float32"), T.ivector("y")
    loss = -T.mean(T.special.log_softmax(T.tanh(x @ W1) @ W2, axis=-1)[T.arange(y.shape[0]), y])
    if what == "run":
        loss = exchange.straggle(loss, {slow_rank: SLOW})
    if what == "raise":                              # NaN rows (the last rank's) make it raise
        from pytensor.raise_op import Assert
        loss = Assert("NaN in this worker's rows")(loss, T.all(T.isfinite(x)))
    ps = exchange.ParameterServer(loss, [W1, W2], [x, y], updates.sgd, learning_rate=0.2, max_staleness=3)
    synk.distribute()
    Xd, Yd = synk.data(X), synk.data(Y)

    def np_loss():
        z = np.tanh(X.astype(np.float64) @ W1.get_value()) @ W2.get_value()
        z = z - z.max(axis=1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(Y)), Y]))

    remote = [r.rank for r in info.ranks if r.host != info.ranks[0].host]
    res = dict(n=n, remote=remote, nbytes=ps.size * 4)
    ps.run(Xd, Yd, steps=4, batch_size=16, verbose=False)          # compiled, loaded everywhere
    if what == "run":
        before = np_loss()
        net0 = _eth0()
        r1 = ps.run(Xd, Yd, max_seconds=1.5, batch_size=16, slow_after=0.1, verbose=False, sync=False)
        net1 = _eth0()
        synk.broadcast([W1, W2])
        res.update(loss_before=before, loss_after=np_loss(), applied=r1.applied, dropped=r1.dropped,
                   staleness=r1.staleness, per_rank=r1.per_rank, seconds=r1.seconds, slow=r1.slow,
                   workers=r1.workers, max_staleness=ps.max_staleness, slow_rank=slow_rank, SLOW=SLOW,
                   loss_by_rank={r: float(np.mean([ev[4] for ev in r1.events if ev[2] == r])) for r in range(1, n)},
                   net=None if net0 is None else [net1[0] - net0[0], net1[1] - net0[1]],
                   weights_equal=all(np.array_equal(synk.get_value(r, W), W.get_value())
                                     for r in range(n) for W in (W1, W2)))
        v0 = ps.version
        res["second_applied"] = ps.run(Xd, Yd, steps=20, batch_size=16, verbose=False).applied
        res["second_version"] = ps.version - v0
        timer = threading.Timer(0.4, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        try:
            ps.run(Xd, Yd, max_seconds=8, batch_size=16, verbose=False)
            res["interrupted"] = False
        except KeyboardInterrupt:
            res["interrupted"] = True
        timer.join()
        res["interrupt_seconds"] = time.monotonic() - t0
        res["after_interrupt"] = ps.run(Xd, Yd, steps=5, batch_size=16, verbose=False).applied
        synk.close()
        _result(**res)
        return
    if what == "raise":
        Xbad = X.copy()
        Xbad[-100:] = np.nan
        t0 = time.monotonic()
        try:
            ps.run(synk.data(Xbad), Yd, max_seconds=8, batch_size=16, verbose=False)
            res["raised"] = None
        except synk.WorkerError as e:
            res.update(raised="WorkerError", ranks=e.ranks, message=str(e)[-600:],
                       has_result=getattr(e, "ps_result", None) is ps.last_result)
        res["seconds"] = time.monotonic() - t0
        res["weights_equal"] = all(np.array_equal(synk.get_value(r, W), W.get_value())
                                   for r in range(n) for W in (W1, W2))
        res["open_after"] = synk.session_info() is not None
        res["after"] = ps.run(Xd, Yd, steps=10, batch_size=16, verbose=False).applied
        synk.close()
        _result(**res)
        return
    victim = [r for r in info.ranks if r.rank == slow_rank][0]
    err = _lose_rank(victim, what, 0.4, lambda: ps.run(Xd, Yd, max_seconds=1.5, batch_size=16, slow_after=0.3,
                                                       verbose=False), res)
    pr = getattr(err, "ps_result", None)
    if pr is not None:
        lost_at = ([t for r, t, _ in pr.dead + pr.slow if r == victim.rank] or [None])[0]
        res.update(dead=pr.dead, slow=pr.slow, lost_at=lost_at, applied=pr.applied,
                   staleness_ok=all(0 <= s <= ps.max_staleness for s in pr.staleness),
                   applied_after={r: sum(1 for ev in pr.events if ev[2] == r and ev[5] and lost_at is not None
                                         and ev[0] > lost_at) for r in range(1, n)})
    synk.close()
    _result(**res)


def ckpt_model():
    """The model of ``scenario_resume`` (also built by tests/test_checkpoint.py in one host's
    session): a small MLP trained with Adam, and its data."""
    import pytensor
    import pytensor.tensor as T
    from synkhronos.extensions import train, updates
    rng = np.random.default_rng(5)
    X = rng.standard_normal((40, 6))
    Y = rng.integers(0, 3, 40).astype(np.int32)
    x, y = T.matrix("x", dtype="float64"), T.ivector("y")
    W1 = pytensor.shared(rng.standard_normal((6, 8)) * 0.5, name="W1")
    W2 = pytensor.shared(rng.standard_normal((8, 3)) * 0.5, name="W2")
    target = T.eq(y[:, None], T.arange(3)).astype("float64")
    loss = T.mean((T.tanh(x.dot(W1)).dot(W2) - target) ** 2)
    step = train.make_train_function(loss, [W1, W2], [x, y], updates.adam, learning_rate=0.05)
    return step, [W1, W2], X, Y


def ckpt_noise():
    """A function of ``scenario_resume``'s model drawing 2 numbers a rank from a random
    generator shared variable (gathered in rank order): each rank's stream is saved."""
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    rng = pytensor.shared(np.random.default_rng(3), name="rng")
    r_next, noise = T.random.normal(0, 1, size=(2,), rng=rng, return_next_rng=True)
    return synk.function([], (noise, "gather"), updates=[(rng, r_next)])


def scenario_resume(ckpt, trace, steps):
    """A checkpoint written by one host's session, resumed on every host with a timeline;
    the state after ``steps`` more steps saved to ``ckpt + '.out'``; each rank's draws of
    ``ckpt_noise`` after the load and after that save."""
    import synkhronos as synk
    synk.fork(None, timeline=trace)
    info = synk.session_info()
    ranks = [(r.rank, r.host, r.pid) for r in info.ranks]
    _info(ranks=ranks, hosts=sorted({h for _, h, _ in ranks}))
    step, params, X, Y = ckpt_model()
    noise = ckpt_noise()
    synk.distribute()
    state = synk.load(ckpt)
    drawn = noise().tolist()
    losses = [float(step(X, Y)) for _ in range(int(steps))]
    synk.save(ckpt + ".out", state={"from": state, "ranks": info.n})
    drawn_after = noise().tolist()
    synk.close()
    _result(losses=losses, n=info.n, drawn=drawn, drawn_after=drawn_after)


def scenario_elastic(ckpt, steps, pause):
    """``synkhronos.elastic`` with its commits on disk (``ckpt``): a job that loses a whole
    host ends, and the same script started again (on the hosts left) goes on from the last
    commit.  Reports each step (``SYNK-INFO``), then the losses and parameters."""
    import synkhronos as synk
    from synkhronos import elastic
    state = elastic.State(step=0, losses=[])

    def setup(n):
        model = ckpt_model()
        synk.distribute()
        return model

    def loop(model, state):
        step, params, X, Y = model
        while state.step < int(steps):
            state.losses = state.losses + [float(step(X, Y))]
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
            _info(step=state.step, n=synk.session_info().n)
            time.sleep(float(pause))
        return [p.get_value().tolist() for p in params]

    started_at = None
    if os.path.exists(ckpt):
        from synkhronos import checkpoint
        started_at = checkpoint.read(ckpt)[0]["state"]["step"]
    params = elastic.run(setup, loop, state, checkpoint=ckpt)
    _result(losses=state.losses, params=params, started_at=started_at)


def scenario_root_lost(n, root, what):
    """An in-graph ``broadcast(x, root)`` whose root is killed / frozen while the other ranks
    wait for it in the broadcast (its share sleeps first); then a shared variable's
    broadcast from that root after the error is refused cleanly (the session is closed)."""
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos import ops
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _fault_ops as fo
    fo.quiet()
    info = _session(n)
    root = int(root)
    x = T.vector("x", dtype="float64")
    f = synk.function([x], (T.sum(ops.broadcast(fo.Fault("sleep")(x), root=root)), "sum"))
    synk.distribute()
    data = np.arange(float(2 * info.n))
    assert abs(f(data) - info.n * float(np.sum(data[2 * root:2 * root + 2]))) < 1e-9
    res = {}
    _lose_rank(info.ranks[root], what, 0.5, lambda: f(fo.with_trigger(data, root, info.n)), res)
    synk.close()
    _result(**res)


