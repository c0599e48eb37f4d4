"""The contract checks of the planes, run on every rank of a live session: every comm
implementation of each rank's stack, the control plane, the device, the launcher and a
channel, whatever the wiring (one host or several, numba or JAX, staged or XLA).

``run()`` runs them all and returns ``{"checks": [(plane, implementation, check, rank,
problem or None)], "implementations": {plane: [names]}}``; ``tests/test_contracts.py`` runs
it under every wiring and asserts that every registered implementation was checked and
that no check found a problem.  Each check compares against numpy on the same values
(every rank can make every rank's inputs: they depend on the rank and the check only)."""
import time
import traceback

import numpy as np

from . import reductions as red
from .channel import FINISHED, RUNNING, WorkerChannel
from .commands import worker_command
from .errors import Aborted
from .launcher import RankGone
from .plans import ArrayRef, Need

_CMD = __name__ + ":"
DTYPES = ("float32", "float64", "int32", "float16")


def inputs(rank, seed, shape, dtype):
    """Rank ``rank``'s input of check ``seed`` (small values: no overflow in any op)."""
    rng = np.random.default_rng(1000 * seed + rank)
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return rng.integers(1, 4, size=shape).astype(dtype)
    return rng.uniform(0.5, 1.5, size=shape).astype(dtype)


def _close(a, b, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind in "iub":
        return np.array_equal(a, b)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    return a.shape == b.shape and np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol,
                                              atol=tol)


class _Results:
    """What one rank found, check by check."""

    def __init__(self, me):
        self.me, self.rows = me, []

    def check(self, plane, impl, name, fn):
        try:
            problem = fn()
        except Exception:
            problem = traceback.format_exc(limit=4)
        self.rows.append((plane, impl, name, self.me.rank, problem))


# ---- comm ---------------------------------------------------------------------------------


def _comm_checks(me, comm, out):
    """Every verb ``comm`` accepts, on this rank (every rank runs the same sequence)."""
    n, rank, dev = me.n, me.rank, me.device
    placement = dev.placement
    to_dev, to_host = dev.to_device, dev.to_host
    seed = [0]

    def next_seed():
        seed[0] += 1
        return seed[0]

    def every(shape, dtype, rows=None):
        s = next_seed()
        return [inputs(r, s, ((rows(r),) + shape[1:]) if rows else shape, dtype) for r in range(n)]

    name = _name(comm)
    key = len(me.shareds)       # the keys reserved for in-graph collectives (none runs meanwhile)
    for dtype in DTYPES:
        for op in red.OPS:
            if not comm.accepts("all_reduce", dtype, op, placement):
                continue

            def all_reduce(dtype=dtype, op=op):
                vals = every((5, 3), dtype)
                scalar = every((), dtype)
                mine = [to_dev(vals[rank]), to_dev(scalar[rank])]
                keep = [np.array(to_host(m), copy=True) for m in mine]
                got = comm.all_reduce([(key, mine[0]), (key + 1, mine[1])], op)
                for g, want in zip(got, (red.combine(op, vals), red.combine(op, scalar))):
                    if not _close(to_host(g), want, dtype):
                        return f"{op} {dtype}: got {to_host(g)!r}, want {want!r}"
                for m, k in zip(mine, keep):
                    if not np.array_equal(to_host(m), k):
                        return "the caller's array was written into"
                return None
            out.check("comm", name, f"all_reduce {op} {dtype}", all_reduce)
        if comm.accepts("reduce", dtype, "sum", placement):
            def reduce(dtype=dtype):
                vals = every((4,), dtype)
                got = comm.reduce([(key, to_dev(vals[rank]))], "sum", 0, in_place=False)
                if rank != 0:
                    return None if got is None else f"rank {rank} (not the root) got {got!r}"
                want = red.combine("sum", vals)
                return None if _close(to_host(got[0]), want, dtype) else f"got {got[0]!r}, want {want!r}"
            out.check("comm", name, f"reduce {dtype}", reduce)
        if comm.accepts("broadcast", dtype, None, placement):
            def broadcast(dtype=dtype):
                vals = every((3, 2), dtype)
                got = comm.broadcast([(key, to_dev(vals[rank]) if rank == 0 else None, dtype)], 0)
                return None if _close(to_host(got[0]), vals[0], dtype) else f"got {got[0]!r}, want {vals[0]!r}"
            out.check("comm", name, f"broadcast {dtype}", broadcast)
        if comm.accepts("all_gatherv", dtype, None, placement):
            def all_gatherv(dtype=dtype):
                vals = every((1, 2), dtype, rows=lambda r: r + 1)          # unequal lengths
                got = comm.all_gatherv([(key, to_dev(vals[rank]))])
                want = np.concatenate(vals)
                return None if _close(to_host(got[0]), want, dtype) else f"got {got[0]!r}, want {want!r}"
            out.check("comm", name, f"all_gatherv {dtype}", all_gatherv)
        if comm.accepts("gatherv", dtype, None, placement):
            def gatherv(dtype=dtype):
                vals = every((1, 3), dtype, rows=lambda r: 2 - r % 2)
                got = comm.gatherv([(key, to_dev(vals[rank]))], n - 1)
                if rank != n - 1:
                    return None if got is None else f"rank {rank} (not the root) got {got!r}"
                parts = got[0]
                if len(parts) != n or not all(_close(to_host(p), v, dtype) for p, v in zip(parts, vals)):
                    return f"got {parts!r}, want {vals!r}"
                return None
            out.check("comm", name, f"gatherv {dtype}", gatherv)
        if comm.accepts("reduce_scatter", dtype, "sum", placement):
            def reduce_scatter(dtype=dtype):
                rows = 2 * n + 1
                vals = every((rows, 2), dtype)
                counts = [2] * (n - 1) + [rows - 2 * (n - 1)]
                full = red.combine("sum", vals)
                near = [(r * rows) // n for r in range(n + 1)]
                given = [sum(counts[:r]) for r in range(n + 1)]
                for scratch in (False, True):
                    got = comm.reduce_scatter([(key, to_dev(vals[rank])), (key + 1, to_dev(vals[rank]))], "sum",
                                              counts=[None, counts], scratch=scratch)
                    for g, b in zip(got, (near, given)):
                        want = full[b[rank]:b[rank + 1]]
                        if not _close(to_host(g), want, dtype):
                            return f"scratch={scratch}: got {g!r}, want {want!r}"
                return None
            out.check("comm", name, f"reduce_scatter {dtype}", reduce_scatter)

    def shapes():
        got = comm.shapes([(rank + 1, 2), ()])
        want = [[(r + 1, 2) for r in range(n)], [() for _ in range(n)]]
        return None if [[tuple(s) for s in per] for per in got] == want else f"got {got}, want {want}"
    out.check("comm", name, "shapes", shapes)

    def barrier():
        comm.barrier()
    out.check("comm", name, "barrier", barrier)
    if n > 1 and comm.accepts("all_reduce", "float32", "sum", placement):
        def unequal_shapes():
            mine = to_dev(np.ones(3 + (rank == n - 1), np.float32))
            try:
                comm.all_reduce([(key, mine)], "sum")
            except ValueError:
                return None                  # on every rank alike
            return "unequal shapes did not raise ValueError"
        out.check("comm", name, "unequal shapes raise", unequal_shapes)


@worker_command(_CMD + "comm")
def _comm(me):
    out = _Results(me)
    for comm in me.comm.impls:
        _comm_checks(me, comm, out)
    return out.rows


# ---- control ------------------------------------------------------------------------------


@worker_command(_CMD + "control")
def _control(me, ref, expect):
    out = _Results(me)
    ctl = me.control
    name = _name(ctl)

    def barrier():
        for _ in range(3):
            ctl.barrier()
    out.check("control", name, "barrier", barrier)

    def vote_yes():
        hits = []
        ok = ctl.vote(True, on_commit=lambda: hits.append(1))
        return None if ok and hits == [1] else f"vote(True) on every rank gave {ok}, commit ran {len(hits)}x"
    out.check("control", name, "vote yes", vote_yes)

    def view():
        got = me.view(ref)
        return None if np.array_equal(got, expect) else f"view of the master's buffer: {got!r}, want {expect!r}"
    out.check("control", name, "view of an allocated buffer", view)
    out.check("control", name, "seq", lambda: None if ctl.seq == me.seq else f"seq {ctl.seq} != {me.seq}")
    return out.rows


@worker_command(_CMD + "vote_no")
def _vote_no(me):
    """One rank votes no: every rank decides "no" (and the command ends everywhere)."""
    ok = me.control.vote(me.rank != me.n - 1, on_commit=lambda: None)
    return [("control", _name(me.control), "vote with one no", me.rank,
             None if ok is False else f"rank {me.rank} decided {ok}")]


@worker_command(_CMD + "abort")
def _abort(me):
    """The last rank aborts the command: every rank's next barrier raises Aborted."""
    ctl = me.control
    if me.rank == me.n - 1:
        ctl.abort()
    problem = "barrier did not raise Aborted"
    try:
        ctl.barrier()
    except Aborted:
        problem = None if ctl.aborted() else "aborted() is False after Aborted"
    return [("control", _name(ctl), "abort", me.rank, problem)]


def _name(obj):
    from .backends import name_of
    return name_of(obj)


# ---- device -------------------------------------------------------------------------------


@worker_command(_CMD + "device")
def _device(me):
    from . import backends
    out = _Results(me)
    dev = me.device
    name = _name(dev)

    def roundtrip():
        src = inputs(me.rank, 99, (4, 3), "float32")
        d = dev.to_device(src)
        if dev.placement == "device":
            src[:] = -1                                 # a device array never aliases host memory
        back = dev.to_host(d)
        dev.wait([d])
        return None if np.array_equal(back, inputs(me.rank, 99, (4, 3), "float32")) else f"got {back!r}"
    out.check("device", name, "to_device / to_host", roundtrip)

    def combine():
        parts = [dev.to_device(inputs(r, 98, (3,), "float32")) for r in range(3)]
        for mode in red.OPS:
            got = dev.to_host(dev.combine(mode, parts, [1.0, 2.0, 1.0]))
            want = red.combine(mode, [dev.to_host(p) for p in parts], [1.0, 2.0, 1.0])
            if not _close(got, want, "float32"):
                return f"{mode}: got {got!r}, want {want!r}"
        return None
    out.check("device", name, "combine", combine)

    def shared_value():
        import pytensor
        var = pytensor.shared(np.zeros(2, np.float32))
        dev.set(var, dev.to_device(np.array([1.0, 2.0], np.float32)))
        return None if np.array_equal(dev.to_host(dev.get(var)), [1.0, 2.0]) else "get after set differs"
    out.check("device", name, "get / set", shared_value)

    def generator_state():
        import pytensor
        from . import generators
        var = pytensor.shared(np.random.default_rng(me.rank))
        saved = dev.generator_state(var)
        dev.set_generator_state(var, generators.state_of(np.random.default_rng(7)))
        moved = dev.generator_state(var)
        dev.set_generator_state(var, saved)
        if dev.generator_state(var) != saved:
            return "a generator state set back is not the state read"
        return "setting another state changed nothing" if moved == saved else None
    out.check("device", name, "generator state", generator_state)

    def config():
        again = backends.make_device(dev.config(), dev.n)
        if again.config() != dev.config() or again.kind != dev.kind or again.placement != dev.placement:
            return f"rebuilt {again.config()} from {dev.config()}"
        return None if isinstance(dev.describe(), str) else "describe() is not a string"
    out.check("device", name, "config rebuilds it", config)
    out.check("device", name, "explain", lambda: None if dev.explain(KeyError("x"), me.rank, "c", []) is None
              else "explain() of an unrelated error is not None")
    return out.rows


# ---- channel ------------------------------------------------------------------------------

_MESSAGES = 3


@worker_command(_CMD + "channel")
def _channel_worker(me, token):
    from . import backends
    ch = backends.attach_channel(me.control, token, me.rank)
    problems = []
    try:
        if not isinstance(ch, WorkerChannel):
            problems.append(f"{type(ch).__name__} does not keep the WorkerChannel contract")
        ch.set_state(RUNNING)
        meta = ch.wait_answer()                        # the master speaks first
        if meta is None or tuple(meta[:2]) != (-1, me.rank):
            problems.append(f"first answer: meta {meta}")
        for i in range(_MESSAGES):
            ch.up(me.rank, np.float64, 2)[:] = (me.rank, i)
            ch.send((i, me.rank))
            meta = ch.wait_answer()
            got = ch.down(me.rank, np.float64, 2)
            if meta is None or tuple(meta[:2]) != (i, 2 * me.rank) or list(got) != [2.0 * me.rank, 2.0 * i]:
                problems.append(f"answer {i}: meta {meta}, data {list(got)}")
        if ch.wait_answer() is not None:
            problems.append("no stop after the last answer")
        ch.set_state(FINISHED)
    finally:
        ch.close()
    return [("channel", "worker", "messages", me.rank, "; ".join(problems) or None)]


def _serve_channel(ch, workers, deadline):
    """The master's end: answer every worker's messages (doubled), then stop."""
    answered = {r: 0 for r in workers}
    problems = []
    for r in workers:                                  # a run starts with the master's answer
        ch.answer(r, (-1, r), consumed=False)
    while any(v < _MESSAGES for v in answered.values()):
        if time.monotonic() > deadline:
            return [f"only {answered} messages arrived"]
        ch.wait_any(0.05)
        for r in ch.pending():
            meta = ch.message(r)
            up = np.array(ch.up(r, np.float64, 2))
            if tuple(meta[:2]) != (answered[r], r) or list(up) != [r, answered[r]]:
                problems.append(f"message of rank {r}: meta {meta}, data {list(up)}")
            ch.down(r, np.float64, 2)[:] = 2 * up
            ch.answer(r, (answered[r], 2 * r))
            answered[r] += 1
    while time.monotonic() < deadline and any(ch.status(r) != "alive" for r in workers):
        ch.wait_any(0.01)                              # (across hosts, states arrive as messages)
    states = {r: ch.status(r) for r in workers}
    if any(s != "alive" for s in states.values()):
        problems.append(f"states of the running workers: {states}")
    ch.stop()
    return problems


# ---- the master's side --------------------------------------------------------------------


def run(timeout=60.0):
    """Run every check on every rank of the current session; see the module docstring."""
    from . import backends
    from .channel import Channel
    from .session import get_session
    session = get_session()
    me = session.me
    rows = []
    with session.api():
        for cmd, args, local, needs in _commands(me):
            mine, theirs = session.execute(cmd, args, local, what=f"contract checks ({cmd})", needs=needs)
            rows += mine
            for r in sorted(theirs):
                rows += theirs[r]
            session.commit()
        workers = list(me.control.workers)
        if workers:
            ch = backends.open_channel(me.control, workers, 64, 64)
            try:
                kind = me.control.channel_kind
                problems = [] if isinstance(ch, Channel) else [f"{type(ch).__name__} breaks the Channel contract"]
                deadline = time.monotonic() + timeout
                _, theirs = session.execute(_CMD + "channel", (ch.token,),
                                            lambda: problems.extend(_serve_channel(ch, workers, deadline)),
                                            what="contract checks (channel)")
                rows.append(("channel", kind, "serve", me.rank, "; ".join(problems) or None))
                for r in sorted(theirs):
                    rows += [(p, kind, c, rk, x) for p, _, c, rk, x in theirs[r]]
            finally:
                ch.close()
        rows += _launcher_checks(session)
    names = {"comm": sorted({_name(c) for c in me.comm.impls}), "control": [_name(me.control)],
             "device": [_name(me.device)], "launcher": [_name(session.launcher)],
             "channel": [me.control.channel_kind] if me.control.workers else []}
    return {"checks": rows, "implementations": names}


def _commands(me):
    """(command, args, the master's share) of each round of checks."""
    buf = me.control.alloc(64)
    expect = np.arange(8, dtype=np.int64)
    buf.array(np.int64, (8,))[:] = expect
    ref = ArrayRef(buf.handle, "<i8", (8,))
    yield _CMD + "comm", (), lambda: _comm(me), ()
    yield _CMD + "control", (ref, expect), lambda: _control(me, ref, expect), (Need(ref),)
    yield _CMD + "device", (), lambda: _device(me), ()
    if me.n > 1:
        yield _CMD + "vote_no", (), lambda: _vote_no(me), ()
        yield _CMD + "abort", (), lambda: _abort(me), ()


def _launcher_checks(session):
    launcher = session.launcher
    name = _name(launcher)
    rows = []
    info = launcher.info()
    ranks = sorted(r for r, _, _ in info)
    want = sorted(session.me.control.workers)
    rows.append(("launcher", name, "info lists every worker", session.rank,
                 None if ranks == want else f"info() ranks {ranks}, workers {want}"))
    bad = [(r, h, p) for r, h, p in info if not (isinstance(h, str) and h and isinstance(p, int) and p > 0)]
    rows.append(("launcher", name, "info gives host and pid", session.rank, f"{bad}" if bad else None))
    try:
        launcher.check()
        problem = None
    except RankGone as g:
        problem = f"check() reported rank {g.rank} gone in a healthy session"
    rows.append(("launcher", name, "check of a healthy session", session.rank, problem))
    rows.append(("launcher", name, "host", session.rank,
                 None if isinstance(launcher.host, str) and launcher.host else "no host"))
    return rows

