"""Master programs of the SIGINT storms, run as ``python _fault_scripts.py sigint_storm |
close_storm | fork_storm ARGS``: calls, training steps and collectives, then ``close()``,
then ``fork()``, under SIGINTs at random instants (``_Storm``).  Every completed result is
checked against a model of every rank's state, every interrupted operation must leave all
or nothing of it, and nothing may be left behind.  They report as the other master programs
(``_fault_scripts._info``, ``_result``)."""
import os
import signal
import sys
import time

import numpy as np

from _fault_ops import quiet
from _fault_scripts import _info, _result


class _Storm:
    """SIGINT to the main thread at random instants while an operation is "armed": at most
    one per armed operation (so an interrupt can never land in the bookkeeping that follows
    it), after a random delay of up to 1.5 times the typical duration of an operation (so
    that interrupts fall at every instant of one, and about half the operations complete);
    each interrupted operation lengthens the delays a little, so that half still complete
    when operations take longer than the completed ones said (a loaded machine).  ``spin``:
    the thread waits by looking between yields, not sleeps, for operations shorter than the
    machine's shortest sleep (one rank's ~80 µs calls: a 20 µs sleep took 94 µs on the
    project's VM, and the storm sent 4 SIGINTs in 170000 operations)."""

    def __init__(self, max_delay, seed, spin=False):
        import random
        import threading
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.spin = spin
        self.armed = False
        self.gen = 0
        self.sent = 0
        self.raised = 0
        self.stop = False
        self.main = threading.main_thread().ident
        signal.signal(signal.SIGINT, self._handler)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _handler(self, signum, frame):
        if self.armed:
            self.armed = False
            self.raised += 1
            raise KeyboardInterrupt

    def _pause(self, seconds):
        if not self.spin:
            time.sleep(seconds)
            return
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            os.sched_yield()             # (the GIL is released: the operation goes on)

    def _run(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        while not self.stop:
            gen = self.gen
            if not self.armed:
                self._pause(20e-6)
                continue
            self._pause(self.rng.uniform(0, self.max_delay))
            if self.armed and self.gen == gen:
                self.sent += 1
                signal.pthread_kill(self.main, signal.SIGINT)
            while self.gen == gen and not self.stop:    # one per armed operation
                self._pause(10e-6)

    def attempt(self, op):
        """(True, result) if ``op()`` completed, (False, None) if it was interrupted."""
        self.gen += 1
        t0 = time.perf_counter()
        self.armed = True
        try:
            res = op()
            self.armed = False
            self.max_delay = 0.97 * self.max_delay + 0.03 * 1.5 * (time.perf_counter() - t0)
            return True, res
        except KeyboardInterrupt:
            self.armed = False
            self.max_delay *= 1.03     # (ops slower than the typical one, e.g. under load: longer
            return False, None         # delays, or the storm would interrupt nearly every op)


_BIG = 20000     # float64 elements: above the small all-reduce's 64 KB on every rank count


def scenario_sigint_storm(target, n, seconds):
    """Calls (one with an in-graph all_reduce), training steps (plain and fp16) and
    collectives under SIGINTs at random instants until ``target`` interrupts (or
    ``seconds``).  Every completed result is checked against a model of every rank's
    state; after every interrupted operation the ranks' state must be the state before or
    after it on every rank at once (all-or-nothing), and it becomes the model."""
    import random
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos import ops
    from synkhronos.shards import split
    quiet()
    target, n, seconds = int(target), int(n), float(seconds)
    if n == 1:       # calls of ~50 us that never wait: let the storm's thread take the GIL within them
        sys.setswitchinterval(2e-5)
    synk.fork(n)
    info = synk.session_info()
    _info(prefix=info.resources["shm_prefix"], pids=[r.pid for r in info.ranks if r.rank != info.master_rank])
    x = T.vector("x", dtype="float64")
    w = pytensor.shared(np.zeros(3), name="w")
    v = pytensor.shared(np.zeros(6), name="v")
    f = synk.function([x], (T.sum(x), "sum"))
    g = synk.function([x], [(T.sum(x), "sum"), (T.sum(w), None)], updates=[(w, w + T.sum(x))])
    h = synk.function([x], [(T.max(x), "max"), (x * 2, "gather"), (T.sum(v), "sum")])
    u = pytensor.shared(np.zeros(2), name="u")      # in-graph all_reduce (no vote of its own)
    tot = ops.all_reduce(T.sum(x) * T.ones(2), "sum")
    q = synk.function([x], (tot, None), updates=[(u, u + tot)])
    from synkhronos.extensions import train, updates
    # training steps, plain and with the fp16 exchange (one rank: its own path); the gradient
    # depends on the data on one rank (elsewhere 1: a mean over ranks is not exact), so that a
    # gradient left behind shows; "big": a gradient too large for the small all-reduce (it
    # lies in the shared-memory slots), depending on every rank's data (compared to 1e-9)
    steps = {}
    for kind, dtype, size in (("step", "float64", 2), ("fp16", "float32", 2), ("big", "float64", _BIG)):
        xv = x if dtype == "float64" else T.vector("x32", dtype=dtype)
        pv = pytensor.shared(np.zeros(size, dtype), name=f"p_{kind}")
        loss = T.sum(pv) * T.sum(xv) if kind == "big" else T.sum(pv) + float(n == 1) * T.sum(xv) * pv[0]
        steps[kind] = pv, train.make_train_function(loss, [pv], [xv], updates.sgd, learning_rate=0.5,
                                                    exchange="fp16" if kind == "fp16" else None)
    synk.distribute()
    q(np.arange(6.0))
    synk.broadcast(u, np.zeros(2))
    for pv, st in steps.values():
        st(np.zeros(n, pv.dtype))
        synk.broadcast([pv, st.state_vars[0]], [np.zeros(len(pv.get_value()), pv.dtype)] * 2)
    XB = np.arange(12.0) % 5 - 2                  # rows that ``batch`` picks (one rank: its own path)
    xd = synk.data(XB)
    for num_slices in (1, 2, 3):                  # compile every variant before the storm
        f(np.arange(6.0), num_slices=num_slices)
        g(np.zeros(6), num_slices=num_slices)
        h(np.arange(6.0), num_slices=num_slices)
    rng = np.random.default_rng(0)
    pick = random.Random(1)
    model = {"w": [np.zeros(3) for _ in range(n)], "v": [np.zeros(6) for _ in range(n)],
             "u": [np.zeros(2) for _ in range(n)]}
    model.update({f"{kind}_{v}": [np.zeros(len(pv.get_value())) for _ in range(n)]
                  for kind, (pv, _) in steps.items() for v in ("p", "gs")})
    res = dict(completed=0, interrupted=0, checked=0, mismatches=[], inconsistent=[], ops={})

    def read(var):
        return [synk.get_value(r, var) for r in range(n)]

    def mismatch(what, got, want):
        if len(res["mismatches"]) < 20:
            res["mismatches"].append(f"{what}: got {got!r} want {want!r}")

    def reconcile(name, var, after):
        """After an interrupted op: every rank holds the model before, or every rank holds
        ``after`` (the model had it completed)."""
        got = read(var)
        before = model[name]
        if all(np.array_equal(a, b) for a, b in zip(got, before)):
            return
        if after is not None and all(np.array_equal(a, b) for a, b in zip(got, after)):
            model[name] = [np.array(a) for a in after]
            return
        if len(res["inconsistent"]) < 20:
            res["inconsistent"].append(f"{name}: ranks hold {[a.tolist() for a in got]}, before "
                                       f"{[a.tolist() for a in before]}, after "
                                       f"{None if after is None else [a.tolist() for a in after]}")
        model[name] = [np.array(a) for a in got]

    def settle(ok, name, var, after, what=None):
        """After an op on ``var``: completed, the model becomes ``after`` (with ``what``, every
        rank's value is checked against it); interrupted, ``reconcile``."""
        if not ok:
            reconcile(name, var, after)
            return
        model[name] = after
        if what is not None:
            got = read(var)
            if not all(np.array_equal(a, c) for a, c in zip(got, after)):
                mismatch(what, got, after)

    storm = _Storm(max_delay=0.0003, seed=2, spin=n == 1)
    jax_ranks = (os.environ.get("SYNK_MODE") or "").strip().upper() == "JAX"
    t_end = time.monotonic() + seconds
    while storm.raised < target and time.monotonic() < t_end:
        op = pick.choice(["f", "g", "g_batch", "h", "all_reduce", "broadcast", "scatter", "gather", "set_get",
                          "ingraph", "step", "fp16", "big"])
        res["ops"][op] = res["ops"].get(op, 0) + 1
        k = int(rng.integers(0, 13))
        xs = rng.integers(-5, 6, k).astype(np.float64)
        b = split(k, n)
        if op == "f":
            ok, out = storm.attempt(lambda: f(xs))
            if ok and out != xs.sum():
                mismatch("f", out, xs.sum())
        elif op == "g":
            after = [model["w"][r] + xs[b[r]:b[r + 1]].sum() if b[r + 1] > b[r] else model["w"][r]
                     for r in range(n)]
            ok, out = storm.attempt(lambda: g(xs))
            if ok and out[0] != xs.sum():
                mismatch("g sum", out[0], xs.sum())
            settle(ok, "w", w, after, "g update")
        elif op == "g_batch":                     # a list of rows (repeats allowed) or a slice
            if pick.random() < 0.6:
                sel = [pick.randrange(12) for _ in range(pick.randint(1, 7))]
            else:
                lo = pick.randrange(12)
                sel = slice(lo, pick.randint(lo + 1, 12))
            rows = XB[sel]
            bb = split(len(rows), n)
            after = [model["w"][r] + rows[bb[r]:bb[r + 1]].sum() if bb[r + 1] > bb[r] else model["w"][r]
                     for r in range(n)]
            ok, out = storm.attempt(lambda: g(xd, batch=sel))
            if ok and out[0] != rows.sum():
                mismatch("g batch sum", out[0], rows.sum())
            settle(ok, "w", w, after, "g batch update")
        elif op == "h":
            if k == 0 and jax_ranks:      # an empty max raises on JAX, in plain PyTensor JAX too
                xs = rng.integers(-5, 6, 1).astype(np.float64)
                k, b = 1, split(1, n)
            ok, out = storm.attempt(lambda: h(xs, num_slices=3))
            if ok:     # sum(v) is computed once per slice (at most 3 per rank) and summed
                want_sum = sum(model["v"][r].sum() * min(3, b[r + 1] - b[r]) for r in range(n))
                if k and (out[0] != xs.max() or not np.array_equal(out[1], xs * 2) or out[2] != want_sum):
                    mismatch("h", out, (xs.max(), xs * 2, want_sum))
        elif op == "ingraph":                     # every rank needs a row: n + k rows
            xs = rng.integers(-5, 6, n + k).astype(np.float64)
            after = [m + xs.sum() for m in model["u"]]
            ok, out = storm.attempt(lambda: q(xs))
            if ok and not np.array_equal(out, [xs.sum()] * 2):
                mismatch("ingraph", out, xs.sum())
            settle(ok, "u", u, after, "ingraph update")
        elif op in steps:                         # every rank needs a row: n + k rows
            pv, st = steps[op]
            xs = rng.integers(-5, 6, n + k).astype(pv.dtype)
            kp, kg = f"{op}_p", f"{op}_gs"
            if op == "big":       # each rank's gradient: the sum of its rows; ranks weigh by rows
                bb = split(n + k, n)
                mean = sum((bb[r + 1] - bb[r]) * xs[bb[r]:bb[r + 1]].sum() for r in range(n)) / (n + k)
                loss = model[kp][0].sum() * mean
                gs = [np.full(_BIG, mean)] * n
            else:
                loss = model[kp][0].sum() + (n == 1) * xs.sum() * model[kp][0][0]
                gs = [np.array([1.0 + (n == 1) * xs.sum(), 1.0])] * n
            after = {kp: [m - 0.5 * g for m, g in zip(model[kp], gs)], kg: gs}
            ok, out = storm.attempt(lambda: st(xs))
            if ok and abs(out - loss) > 1e-6 * max(1.0, abs(loss)):      # (float32: the loss rounds)
                mismatch(f"{op} loss", out, loss)
            got = {kp: read(pv), kg: read(st.state_vars[0])}
            # (uneven shards weigh each rank's gradient by its rows: a scaling that rounds,
            # in float16 on the fp16 exchange's wire; a step moves the parameters by ~0.5)
            tol = 2e-3 if op == "fp16" else 1e-9
            same = lambda a, b: np.allclose(a, b, rtol=0, atol=tol)     # noqa: E731

            def holds(state):
                return all(same(a, b) for k in state for a, b in zip(got[k], state[k]))
            if ok and not holds(after):
                mismatch(f"{op} update", got, after)
            elif not ok and not holds(after) and not holds({k: model[k] for k in after}) \
                    and len(res["inconsistent"]) < 20:
                res["inconsistent"].append(f"{op} interrupted: ranks hold {got}, before "
                                           f"{ {k: model[k] for k in after} }, after {after}")
            model.update(got)
        elif op == "all_reduce":
            after = [sum(model["v"])] * n
            ok, _ = storm.attempt(lambda: synk.all_reduce(v, op="sum"))
            settle(ok, "v", v, after)
        elif op == "broadcast":
            val = rng.integers(-9, 10, 6).astype(np.float64)
            ok, _ = storm.attempt(lambda: synk.broadcast(v, val))
            settle(ok, "v", v, [val] * n)
        elif op == "scatter":
            val = rng.integers(-9, 10, 6 * n).astype(np.float64)
            after = [val[6 * r:6 * r + 6] for r in range(n)]
            ok, _ = storm.attempt(lambda: synk.scatter(v, val))
            settle(ok, "v", v, after)
        elif op == "gather":
            ok, out = storm.attempt(lambda: synk.gather(v))
            if ok and not np.array_equal(out, np.stack(model["v"])):
                mismatch("gather", out, model["v"])
        else:
            r = int(rng.integers(0, n))
            val = rng.integers(-9, 10, 3).astype(np.float64)
            ok, _ = storm.attempt(lambda: synk.set_value(r, w, val))
            after = [val if q == r else model["w"][q] for q in range(n)]
            if ok:
                model["w"] = after
                ok2, got = storm.attempt(lambda: synk.get_value(r, w))
                if ok2 and not np.array_equal(got, val):
                    mismatch("get_value", got, val)
            else:
                reconcile("w", w, after)
        res["completed" if ok else "interrupted"] += 1
        res["checked"] += 1
    storm.stop = True
    storm.thread.join()
    res["interrupts"] = storm.raised
    res["typical_op_us"] = storm.max_delay / 1.5 * 1e6
    res["sigints_sent"] = storm.sent
    finals = [("w", w), ("v", v), ("u", u)] + [(f"{kind}_{v}", var) for kind, (pv, st) in steps.items()
                                               for v, var in (("p", pv), ("gs", st.state_vars[0]))]
    for name, var in finals:                      # the end state agrees with the model
        got = read(var)
        if not all(np.array_equal(a, c) for a, c in zip(got, model[name])):
            mismatch(f"final {name}", got, model[name])
    res["final_f"] = float(f(np.arange(10.0)))
    synk.close()
    res["left"] = [e for e in os.listdir("/dev/shm") if e.startswith(info.resources["shm_prefix"].lstrip("/"))]
    _result(**res)


def scenario_close_storm(sessions):
    """``sessions`` sessions, each closed (``synk.close()``, again after each interrupt)
    under SIGINTs every 0.05-2 ms: each must end with its workers gone and nothing of it in
    /dev/shm.  (A Ctrl-C half way through a close once left a session's segments for good,
    ~1 in 30: its memory given back before its names went, the master's pid with it.)"""
    import random
    import threading
    import pytensor
    import synkhronos as synk
    pick = random.Random(7)
    res = {"closed": 0, "interrupts": 0, "ignored": 0, "left": {}, "alive": {}}
    armed = []

    def gate(signum, frame):
        """Raise only inside the close below, once per try: an interrupt landing in this
        script's own bookkeeping (a thread start, a loop jump) is not what is tested."""
        if armed:
            armed.clear()
            raise KeyboardInterrupt
        res["ignored"] += 1
    signal.signal(signal.SIGINT, gate)      # synkhronos defers and then calls this handler
    for k in range(int(sessions)):
        synk.fork(2)
        info = synk.session_info()
        prefix, pids = info.resources["shm_prefix"].lstrip("/"), [r.pid for r in info.ranks if r.rank]
        v = pytensor.shared(np.zeros(1 << 19, "float32"), name="v")
        synk.function([], v.sum())
        synk.distribute()
        synk.all_reduce(v, "sum")
        stop = []

        def storm():
            while not stop:
                time.sleep(pick.uniform(5e-5, 2e-3))
                os.kill(os.getpid(), signal.SIGINT)
        t = threading.Thread(target=storm, daemon=True)
        t.start()
        while synk.session_info() is not None:
            try:
                try:
                    armed.append(1)
                    synk.close()
                finally:
                    armed.clear()
            except KeyboardInterrupt:
                res["interrupts"] += 1
        stop.append(1)
        t.join()
        res["closed"] += 1
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
            time.sleep(0.05)
        left = [e for e in os.listdir("/dev/shm") if e.startswith(prefix) or e.startswith("sem." + prefix)]
        if left:
            res["left"][prefix] = left
        alive = [p for p in pids if os.path.exists(f"/proc/{p}")]
        if alive:
            res["alive"][prefix] = alive
    _result(**res)


def scenario_fork_storm(sessions):
    """``sessions`` times ``synk.fork(3)`` with 1-3 SIGINTs at a random instant of it (the
    workers forked by the fork server, its first start included): each fork ends started or
    interrupted, leaving nothing of it in /dev/shm.  The instants fall within twice the
    length of the last fork that ended (a fast machine forks in 30 ms); the second fork is
    interrupted at its start and the last one is left alone, so that both outcomes occur;
    after each, ``close()`` leaves no worker of it running.  Reports the fork server(s) this
    process has, for the test to see them end with it."""
    import random
    import tempfile
    import threading
    import synkhronos as synk
    import synk_testutil as tu
    pick = random.Random(11)
    res = {"started": 0, "interrupted": 0, "alive": [], "left": [], "servers": []}
    # this program's sessions (each prefix is logged as it is made; others are not looked at)
    log = os.environ.get("SYNK_PREFIX_LOG") or os.path.join(tempfile.mkdtemp(), "prefixes")
    os.environ["SYNK_PREFIX_LOG"] = log
    start = os.path.getsize(log) if os.path.exists(log) else 0

    def mine():
        with open(log) as fh:
            fh.seek(start)
            return tuple(p.strip().lstrip("/") + "_" for p in fh if p.strip())
    armed = []

    def gate(signum, frame):
        if armed:
            armed.clear()
            raise KeyboardInterrupt
    signal.signal(signal.SIGINT, gate)
    took = 1.5                  # the last fork's length (the first starts the fork server: ~1.5 s)
    for k in range(int(sessions)):
        stop = []
        wait = 0.0 if k == 1 else 5 * took if k == int(sessions) - 1 else pick.uniform(0.0, 2 * took)

        def storm():
            time.sleep(wait)
            for _ in range(pick.randint(1, 3)):
                if stop:
                    return
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(pick.uniform(5e-5, 3e-3))
        t = threading.Thread(target=storm, daemon=True)
        t.start()
        try:
            try:
                armed.append(1)
                t0 = time.monotonic()
                synk.fork(3)
                took = time.monotonic() - t0
            finally:
                armed.clear()
            res["started"] += 1
        except KeyboardInterrupt:
            res["interrupted"] += 1
        stop.append(1)
        t.join()
        synk.close()
        if not tu.wait_until(lambda: not tu.worker_children(), 5.0):
            res["alive"].append(tu.worker_children())
        bases = mine()
        left = [e for e in os.listdir("/dev/shm") if e.startswith(bases + tuple("sem." + b for b in bases))]
        if left:
            res["left"].append(left)
    res["servers"] = tu.fork_servers()
    _result(**res)
