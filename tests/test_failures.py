"""Failures end in exceptions, never hangs, and leave nothing behind.

* a worker's exception -> WorkerError naming the rank, with the worker's traceback; the
  runtime keeps working;
* bad arguments -> TypeError/ValueError/IndexError raised in the master before any command
  is sent; the runtime keeps working;
* life-cycle misuse (call before distribute, function() after distribute, distribute
  twice, fork while forked) -> RuntimeError;
* fork -> close -> fork, close twice;
* a SIGKILLed worker -> WorkerDied within seconds, runtime closed, no /dev/shm entries, no
  processes, and fork works again;
* a master killed by a signal -> its workers exit and the session's /dev/shm entries go.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest
import pytensor as theano
import pytensor.tensor as T
from pytensor.raise_op import Assert

import synkhronos as synk
import synk_testutil as tu

CRASH_DEADLINE = 10.0     # seconds within which a crash must surface as an exception


def _g1_graph():
    """The introductory example's graph (shared with other modules: JIT cache hit)."""
    x = T.matrix("x", dtype="float32")
    y = T.vector("y", dtype="float32")
    return x, y, T.mean(x.dot(y), axis=0)


def _g1_ref(X, Y):
    return float(np.mean(X.astype(np.float64) @ Y.astype(np.float64)))


RNG = np.random.default_rng(5)
X = RNG.standard_normal((9, 4)).astype(np.float32)
Y = RNG.standard_normal(4).astype(np.float32)
A = np.arange(1, 8, dtype=np.float32)
B = np.linspace(-1, 1, 7).astype(np.float32)


# ==============================================================================================
# In one session: worker exceptions and bad arguments

@pytest.fixture(scope="class")
def S():
    synk.fork(n_parallel=2)
    try:
        x, y, z = _g1_graph()
        g1 = synk.function([x], z, bcast_inputs=[y])
        a = T.vector("a", dtype="float32")
        b = T.vector("b", dtype="float32")
        f7 = synk.function([a, b], (T.sum(a * b), "sum"))
        xv = T.vector("xv", dtype="float32")
        checked = Assert("synk-test: value too large")(T.sum(xv), T.all(T.lt(xv, 100)))
        h = synk.function([xv], (checked, "sum"))
        w = theano.shared(np.zeros(3, np.float32), name="w_upd")
        hu = synk.function([xv], (checked, "sum"), updates=[(w, w + T.sum(xv))])
        synk.distribute()
        yield types.SimpleNamespace(g1=g1, f7=f7, h=h, hu=hu, w=w, a=a)
    finally:
        synk.close()


class TestInSession:

    def good_calls(self, S):
        assert np.isclose(S.g1(X, Y), _g1_ref(X, Y), rtol=1e-5)
        assert np.isclose(S.f7(synk.data(A), synk.data(B)), float(np.sum(A * B)), rtol=1e-5, atol=1e-6)
        assert S.h(np.arange(6, dtype=np.float32)) == 15.0

    def test_good_calls(self, S):
        self.good_calls(S)

    def test_worker_exception_names_rank_and_has_traceback(self, S):
        bad = np.array([1, 2, 3, 500], dtype=np.float32)     # only rank 1's shard fails
        t0 = time.monotonic()
        with pytest.raises(synk.WorkerError) as ei:
            S.h(bad)
        assert time.monotonic() - t0 < CRASH_DEADLINE
        e = ei.value
        assert isinstance(e, synk.SynkError) and isinstance(e, RuntimeError)
        assert set(e.errors) == {1} and e.ranks == [1]
        msg = str(e)
        assert "rank 1" in msg
        assert "Traceback" in e.errors[1] and "AssertionError" in e.errors[1]
        assert "synk-test: value too large" in e.errors[1]
        assert "synk-test: value too large" in msg     # the traceback text is in the message
        # the runtime keeps working, repeatedly
        for _ in range(3):
            self.good_calls(S)
        with pytest.raises(synk.WorkerError):
            S.h(synk.data(bad))
        self.good_calls(S)

    def test_exception_in_master_and_worker(self, S):
        bad = np.array([500, 2, 3, 500], dtype=np.float32)   # both shards fail
        with pytest.raises(AssertionError, match="synk-test") as ei:
            S.h(bad)
        cause = ei.value.__cause__
        assert isinstance(cause, synk.WorkerError) and cause.ranks == [1]
        bad = np.array([500, 2, 3, 4], dtype=np.float32)     # only the master's shard fails
        with pytest.raises(AssertionError, match="synk-test"):
            S.h(bad)
        self.good_calls(S)

    def test_shape_error_in_every_rank(self, S):
        # a broadcast input of the wrong length fails inside PyTensor on all ranks
        with pytest.raises(Exception):
            S.g1(X, np.ones(7, np.float32))
        self.good_calls(S)

    def test_signal_handler_exception_interrupts_a_wait(self, S):
        """A Python signal handler that raises (pytest-timeout, a user's alarm) must end a
        call that waits for a hung worker, as Ctrl-C does; the runtime stays usable."""
        import threading

        class Interrupted(Exception):
            pass

        def handler(signum, frame):
            raise Interrupted("signal handler ran")

        pid = tu.pid_of(1)
        old = signal.signal(signal.SIGUSR1, handler)
        main = threading.main_thread().ident
        poke = threading.Timer(0.5, lambda: signal.pthread_kill(main, signal.SIGUSR1))
        resume = threading.Timer(2.5, lambda: os.kill(pid, signal.SIGCONT))
        os.kill(pid, signal.SIGSTOP)               # the worker hangs: the call must wait
        t0 = time.monotonic()
        raised = None
        try:
            poke.start()
            resume.start()
            try:
                S.g1(X, Y)
            except Exception as e:               # the handler's exception, or one naming the signal
                raised = e
            dt = time.monotonic() - t0
        finally:
            signal.signal(signal.SIGUSR1, old)
            os.kill(pid, signal.SIGCONT)
            poke.cancel()
            resume.cancel()
            poke.join()
            resume.join()
        # the runtime recovers: the interrupted command is collected by the next one
        self.good_calls(S)
        assert raised is not None, f"the call ignored the signal handler and returned after {dt:.1f} s"
        assert dt < 2.0

    BAD_CALLS = [
        # (id, function attr, args, kwargs, exception)
        ("missing_input", "g1", (X,), {}, TypeError),
        ("too_many_inputs", "g1", (X, Y, Y), {}, TypeError),
        ("wrong_dtype_data", "g1", ("data:X64", Y), {}, TypeError),
        ("wrong_dtype_numpy_downcast", "g1", (X.astype(np.float64), Y), {}, TypeError),
        ("wrong_ndim_data", "g1", ("data:Y", Y), {}, TypeError),
        ("wrong_ndim_numpy", "g1", (X[None], Y), {}, TypeError),
        ("bcast_wrong_ndim", "g1", (X, X), {}, TypeError),
        ("python_lists_accepted", "f7", ([1.5, 2.5], [1, 2]), {}, None),   # not an error
        ("unequal_lengths", "f7", (A, B[:-1]), {}, ValueError),
        ("unequal_lengths_data", "f7", ("data:A", "data:B5"), {}, ValueError),
        ("num_slices_zero", "g1", (X, Y), {"num_slices": 0}, ValueError),
        ("num_slices_negative", "g1", (X, Y), {"num_slices": -2}, ValueError),
        ("num_slices_bool", "g1", (X, Y), {"num_slices": True}, ValueError),
        ("num_slices_float", "g1", (X, Y), {"num_slices": 2.0}, ValueError),
        ("unknown_kwarg", "g1", (X, Y), {"foo": Y}, TypeError),
        ("input_given_twice", "g1", (X, Y), {"x": X}, TypeError),
        ("batch_int_too_long", "g1", (X, Y), {"batch": 10}, IndexError),
        ("batch_negative_int", "g1", (X, Y), {"batch": -1}, IndexError),
        ("batch_slice_out_of_range", "g1", (X, Y), {"batch": slice(2, 12)}, IndexError),
        ("batch_slice_step", "g1", (X, Y), {"batch": slice(0, 4, 2)}, ValueError),
        ("batch_slice_open", "g1", (X, Y), {"batch": slice(None, 4)}, TypeError),
        ("batch_index_out_of_range", "g1", (X, Y), {"batch": [0, 9]}, IndexError),
        ("batch_index_negative", "g1", (X, Y), {"batch": [-1, 2]}, IndexError),
        ("batch_index_float", "g1", (X, Y), {"batch": [0.5, 1.0]}, TypeError),
        ("batch_index_2d", "g1", (X, Y), {"batch": np.zeros((2, 2), int)}, ValueError),
        ("batch_bad_type", "g1", (X, Y), {"batch": "all"}, TypeError),
        ("batch_s_without_sliceable", "g1", (X, Y), {"batch_s": slice(0, 2)}, ValueError),
        ("output_subset_out_of_range", "g1", (X, Y), {"output_subset": [1]}, IndexError),
        ("output_subset_repeated", "f7", (A, B), {"output_subset": [0, 0]}, ValueError),
        ("output_subset_not_list", "g1", (X, Y), {"output_subset": 0}, TypeError),
    ]

    @pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
    def test_bad_arguments_rejected_in_master(self, S, case):
        _, fname, args, kwargs, exc = case
        f = getattr(S, fname)
        subs = {"data:X64": lambda: synk.data(X.astype(np.float64)), "data:Y": lambda: synk.data(Y),
                "data:A": lambda: synk.data(A), "data:B5": lambda: synk.data(B[:5])}
        args = tuple(subs[a]() if isinstance(a, str) and a in subs else a for a in args)
        seq = tu.commands_sent()
        if exc is None:
            f(*args, **kwargs)
        else:
            with pytest.raises(exc):
                f(*args, **kwargs)
            assert tu.commands_sent() == seq, "a command was sent to the workers"
        self.good_calls(S)

    @pytest.mark.parametrize("num_slices", [1, 2])
    @pytest.mark.parametrize("where", ["worker", "master"])
    def test_failed_call_applies_no_update(self, S, where, num_slices):
        """A call that fails on one rank (an Assert on its shard) applies its updates on no
        rank, as serial PyTensor applies none when a call raises; then a good call applies
        them on every rank."""
        start = [np.full(3, float(r + 1), np.float32) for r in range(2)]
        for r in range(2):
            synk.set_value(r, S.w, start[r])
        bad = np.arange(8, dtype=np.float32)
        bad[6 if where == "worker" else 1] = 500.0     # rank 1 holds rows 4:8, the master 0:4
        with pytest.raises((synk.WorkerError, AssertionError)) as ei:
            S.hu(bad, num_slices=num_slices)
        if where == "worker":
            assert isinstance(ei.value, synk.WorkerError) and ei.value.ranks == [1]
        else:
            assert not isinstance(ei.value, synk.WorkerError)
        for r in range(2):
            np.testing.assert_array_equal(synk.get_value(r, S.w), start[r])
        good = np.arange(8, dtype=np.float32)
        assert S.hu(good, num_slices=num_slices) == good.sum()
        for r in range(2):      # per slice w + sum(slice), averaged over the (equal) slices
            want = start[r] + good[4 * r:4 * r + 4].sum() / num_slices
            np.testing.assert_array_equal(synk.get_value(r, S.w), want)
        self.good_calls(S)

    def test_function_after_distribute(self, S):
        a = T.vector("a", dtype="float32")
        with pytest.raises(RuntimeError, match="distribute") as ei:
            synk.function([a], T.sum(a))
        assert "before calling synk.distribute()" in str(ei.value)      # says what to do instead
        self.good_calls(S)

    def test_wrong_ndim_names_the_input(self, S):
        with pytest.raises(TypeError, match=r"input 0 \(xv\): wrong number of dimensions: expected 1, got 2"):
            S.h(np.ones((2, 3), np.float32))

    def test_original_module_paths_and_as_theano_subset(self, S):
        import synkhronos.data_module as dm
        import synkhronos.function_module as fm
        assert fm.Function is synk.Function and dm.Data is synk.Data
        assert isinstance(S.g1, fm.Function) and isinstance(synk.data(A), dm.Data)
        both = S.f7.as_theano(A, B, output_subset=[0])
        assert isinstance(both, list) and both[0] == pytest.approx(float(np.sum(A * B)), rel=1e-5)

    def test_distribute_twice(self, S):
        seq = tu.commands_sent()
        with pytest.raises(RuntimeError, match="distribute"):
            synk.distribute()
        assert tu.commands_sent() == seq
        self.good_calls(S)

    def test_fork_while_forked(self, S):
        with pytest.raises(RuntimeError, match="already forked"):
            synk.fork(2)
        assert tu.is_open()
        self.good_calls(S)


# ==============================================================================================
# Sessions of their own

def test_fork_argument_errors():
    assert synk.session_info() is None
    with pytest.raises(ValueError):
        synk.fork(n_parallel=0)
    with pytest.raises(TypeError):
        synk.fork(n_parallel=1.5)
    with pytest.raises(TypeError):
        synk.fork(n_parallel=True)
    with pytest.raises(ValueError):
        synk.fork(n_parallel=2, master_rank=2)
    with pytest.raises(ValueError):
        synk.fork(n_parallel=2, master_rank=-1)
    assert synk.session_info() is None
    assert tu.worker_children() == []
    with pytest.raises(RuntimeError, match="fork"):
        synk.distribute()
    with pytest.raises(RuntimeError, match="fork"):
        synk.function([T.vector("a")], T.sum(T.vector("a")))
    synk.close()          # closing with nothing open is harmless


def test_lifecycle_fork_close_fork(assert_clean):
    try:
        # --- first session: misuse before distribute ---------------------------------------
        assert synk.fork(2) == 2
        x, y, z = _g1_graph()
        f = synk.function([x], z, bcast_inputs=[y])
        xd, yd = synk.data(X), synk.data(Y)      # Data may be made before distributing
        # bad definitions are rejected while building
        with pytest.raises(ValueError):
            synk.function([x], (z, "mean"), bcast_inputs=[y])
        with pytest.raises(TypeError):
            synk.function([x], (z, "sum", 1), bcast_inputs=[y])
        with pytest.raises(TypeError):
            synk.function(x, z, bcast_inputs=[y])
        with pytest.raises(ValueError):
            synk.function([x], z, bcast_inputs=[y], updates=[(theano.shared(np.float32(0)), z, "gather")])
        with pytest.raises(TypeError):
            synk.function([x], z, bcast_inputs=[y], updates=[(x, z)])   # not a shared variable
        with pytest.raises(RuntimeError, match="distribute"):
            f(xd, yd)
        synk.distribute()
        assert np.isclose(f(xd, yd), _g1_ref(X, Y), rtol=1e-5)
        with pytest.raises(RuntimeError, match="distribute"):
            synk.function([x], z, bcast_inputs=[y])
        with pytest.raises(RuntimeError, match="distribute"):
            synk.distribute()
        assert np.isclose(f(X, Y), _g1_ref(X, Y), rtol=1e-5)
        prefix1 = tu.prefix()
        synk.close()
        assert synk.session_info() is None
        assert tu.shm_entries(prefix1) == []
        assert tu.worker_children() == []
        synk.close()                              # twice is harmless
        with pytest.raises(RuntimeError):
            f(X, Y)                               # a function of a closed session
        with pytest.raises(RuntimeError):
            xd.set_value(X[:3])                   # a Data of a closed session
        with pytest.raises(RuntimeError):
            synk.data(X)

        # --- second session ----------------------------------------------------------------
        assert synk.fork(2) == 2
        assert tu.prefix() != prefix1
        x, y, z = _g1_graph()
        f2 = synk.function([x], z, bcast_inputs=[y])
        synk.distribute()
        assert np.isclose(f2(synk.data(X), synk.data(Y)), _g1_ref(X, Y), rtol=1e-5)
        assert np.isclose(f2(X, Y), _g1_ref(X, Y), rtol=1e-5)
        with pytest.raises(RuntimeError):
            f2(xd, yd)                            # Data of the first session
        with pytest.raises(RuntimeError):
            f(X, Y)
        synk.close()
        synk.close()
    finally:
        synk.close()
    assert_clean()


_MASTER_SCRIPT = textwrap.dedent("""
    import faulthandler, json, time
    faulthandler.enable()            # (SIGABRT from the test: every thread's stack, if it hangs)
    import numpy as np
    import pytensor.tensor as T
    import synkhronos as synk

    synk.fork(2)
    a = T.vector("a", dtype="float32")
    f = synk.function([a], (T.sum(a), "sum"))
    synk.distribute()
    d = synk.data(np.arange(10, dtype=np.float32))
    assert f(d) == 45.0
    info = synk.session_info()
    print("SYNK-INFO " + json.dumps({"prefix": info.resources["shm_prefix"],
                                     "pids": [r.pid for r in info.ranks if r.rank != info.master_rank]}),
          flush=True)
    time.sleep(120)
""")

def _default_signals():
    for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)


@pytest.mark.parametrize("sig,target", [
    pytest.param(signal.SIGKILL, "master", id="KILL-master"),
    pytest.param(signal.SIGTERM, "master", id="TERM-master"),
    pytest.param(signal.SIGINT, "group", id="INT-group"),        # Ctrl-C in a terminal
    pytest.param(signal.SIGTERM, "group", id="TERM-group"),
    pytest.param(signal.SIGHUP, "group", id="HUP-group"),
])
def test_master_crash_leaves_nothing(tmp_path, sig, target):
    """A master process that dies by a signal: its workers exit within seconds and the
    session's /dev/shm entries are removed."""
    script = tmp_path / "master.py"
    script.write_text(_MASTER_SCRIPT)
    out_path = tmp_path / "out.txt"
    info = None
    with open(out_path, "w") as out:
        # (the signals at their defaults, as in a terminal: a runner started under ``nohup``
        # would pass SIGHUP on ignored, and synkhronos leaves an ignored signal ignored)
        proc = subprocess.Popen([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=str(tmp_path), start_new_session=True,
                                preexec_fn=_default_signals)
    try:
        def started():
            return proc.poll() is not None or "SYNK-INFO " in out_path.read_text()
        assert tu.wait_until(started, 240, interval=0.1), "the script did not start in time"
        text = out_path.read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith("SYNK-INFO ")]
        assert lines, f"the script did not report its session:\n{text}"
        info = json.loads(lines[0][len("SYNK-INFO "):])
        assert len(info["pids"]) == 1 and tu.pid_running(info["pids"][0])
        if target == "group":
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGABRT)
            proc.wait(timeout=10)
            pytest.fail(f"the master did not exit within 30 s of {sig!r}; its stacks:\n{out_path.read_text()[-6000:]}")
        t_dead = time.monotonic()
        if sig == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL
        gone = tu.wait_until(lambda: not any(tu.pid_running(p) for p in info["pids"]), 5.0)
        assert gone, f"workers {info['pids']} still running 5 s after their master died"
        clean = tu.wait_until(lambda: not tu.shm_entries(info["prefix"]), 5.0)
        assert clean, f"left in /dev/shm: {tu.shm_entries(info['prefix'])}"
        assert time.monotonic() - t_dead < 6.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if info is not None:
            for p in info["pids"]:
                if tu.pid_running(p):
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
            tu.remove_all(info["prefix"])


_FORKING_SCRIPT = textwrap.dedent("""
    import faulthandler, signal, sys, time
    import synkhronos as synk
    faulthandler.register(signal.SIGUSR2, all_threads=True)   # (the test's view of a hang)
    print("FORKING", flush=True)
    synk.fork(2)
    print("FORKED", flush=True)
    time.sleep(120)
""")


def test_sigterm_while_the_workers_start_leaves_nothing(tmp_path):
    """SIGTERM to a master inside ``synk.fork()`` (a job cancelled while it starts), at
    moments spread over the workers' start-up: the master exits with 128 + 15 and nothing of
    the session is left, no worker and no /dev/shm entry (SIGTERM used to kill a master still
    starting outright: its control segments stayed)."""
    script = tmp_path / "master.py"
    script.write_text(_FORKING_SCRIPT)
    hit_start = 0
    for delay in (0.0, 0.05, 0.12, 0.2, 0.3, 0.45, 0.7):
        log = tmp_path / f"prefixes-{delay}.log"
        out_path = tmp_path / f"out-{delay}.txt"
        env = dict(os.environ, SYNK_PREFIX_LOG=str(log))
        with open(out_path, "w") as out:
            proc = subprocess.Popen([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=str(tmp_path), env=env,
                                    start_new_session=True, preexec_fn=_default_signals)
        try:
            assert tu.wait_until(lambda: proc.poll() is not None or "FORKING" in out_path.read_text(), 120,
                                 interval=0.005)
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:      # a hang: where every thread of the master is
                os.kill(proc.pid, signal.SIGUSR2)
                time.sleep(1.0)
                pytest.fail(f"{delay} s into fork(): the master did not end within 30 s of SIGTERM:\n"
                            f"{out_path.read_text()[-6000:]}")
            text = out_path.read_text()
            prefixes = log.read_text().split() if log.exists() else []
            # (killed by the signal itself only before fork() made anything: its first steps
            # choose the devices, before the handlers go in)
            assert rc == 128 + signal.SIGTERM or (rc == -signal.SIGTERM and not prefixes), \
                f"exit {rc}, sessions {prefixes}:\n{text[-3000:]}"
            hit_start += "FORKED" not in text
            for pre in prefixes:
                assert tu.wait_until(lambda: not tu.shm_entries(pre), 5.0), \
                    f"{delay} s into fork(): left in /dev/shm: {tu.shm_entries(pre)}"
            marker = f"SYNK_PREFIX_LOG={log}".encode()
            assert tu.wait_until(lambda: not tu.processes_with_env(marker), 5.0), \
                f"{delay} s into fork(): processes left: {tu.processes_with_env(marker)}"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert hit_start >= 2, "too few signals landed inside fork(): the test does not test"


def test_leak_check_looks_only_at_its_own_run(tmp_path, assert_clean):
    """scripts/leakcheck.py (run by scripts/test.sh) reports what a run left, and only that:
    a live session of another run (another prefix log) is not counted; this run's is."""
    import subprocess as sp
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                          "leakcheck.py")
    other = tmp_path / "other-run.log"
    other.write_text("/synk_0123456789abcdef\n")
    try:
        synk.fork(2)                                 # a live session of *this* run
        ok = sp.run([sys.executable, script, str(other)], capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and "clean" in ok.stderr, ok.stderr
        mine = sp.run([sys.executable, script, tu.PREFIX_LOG], capture_output=True, text=True, timeout=60)
        assert mine.returncode == 1, mine.stderr
        assert tu.prefix().lstrip("/") in mine.stderr and "synkhronos.worker" in mine.stderr
    finally:
        synk.close()
    assert_clean()


_NO_FILES_SCRIPT = textwrap.dedent("""
    import numpy as np, pytensor, pytensor.tensor as T, synkhronos as synk
    from synkhronos.extensions import train, updates
    synk.fork(2)
    x = T.matrix("x"); y = T.vector("y")
    w = pytensor.shared(np.zeros(3), name="w")
    f = synk.function([x], ((x * 2).sum(), "sum"))
    step = train.make_train_function(((x.dot(w) - y) ** 2).mean(), [w], [x, y], updates.sgd,
                                     learning_rate=0.1)
    synk.distribute()
    X = np.arange(12.0).reshape(4, 3)
    assert f(X) == 2 * X.sum()
    step(X, np.ones(4))
    synk.close()
    print("done")
""")


def test_a_session_leaves_no_file(tmp_path):
    """PyTensor writes the source of every graph it compiles to a file, by default a new
    temporary file that is never removed: the master's compiles and every worker's would
    pile up in the temporary directory run after run.  A session leaves nothing there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = tu.program_env()
    env["TMPDIR"] = str(tmp)
    run = subprocess.run([sys.executable, "-c", _NO_FILES_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300, cwd=str(tmp_path))
    assert run.returncode == 0 and "done" in run.stdout, run.stdout + run.stderr
    assert sorted(os.listdir(tmp)) == []
