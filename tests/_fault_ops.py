"""Fault injection for the synkhronos tests: misbehaving Ops and start-up faults.

1. ``Fault(action, rank, when)``: a test-only PyTensor Op (identity on a float vector) that,
   in worker process ``rank`` (never in the master), raises ``FaultInjected``, SIGKILLs its
   own process, or calls ``synk.fork()``:

   * ``when="unpickle"``: while the worker unpickles the functions at ``synk.distribute()``
     (``__setstate__``);
   * ``when="perform"``: while computing, only if its shard holds ``TRIGGER`` (the fault is
     data-dependent: the same function works on clean data);
   * ``action="sleep"`` sleeps ``SLEEP_S`` seconds in *every* rank whose shard holds
     ``TRIGGER``, the master included: a long call to interrupt.

   The Op lives in this module, which workers can import (the master passes its
   ``sys.path`` on), so it pickles.  PyTensor's numba backend has no implementation for it
   and runs ``perform`` in object mode (a warning, silenced by ``quiet()``).  ``Lag`` (a
   slow rank) and ``AtExit`` (a worker's exit handlers, its unflushed output) are Ops of the
   same kind.

2. ``startup_fault_env(tmp_path, spec)``: environment that makes worker processes fail while
   starting (before they answer the master): a ``sitecustomize`` module put on PYTHONPATH
   (which the master hands to its workers).  ``spec`` is ``"kill:R"`` (SIGKILL itself),
   ``"raise:R"`` (``import pytensor`` fails, as with a bad ``PYTENSOR_FLAGS``) or
   ``"sleep:R:S"`` (start S seconds late), for worker rank R; several specs joined by ``,``.

The master programs that use them in subprocesses are in ``_fault_scripts.py``."""
import json
import os
import signal
import sys
import time
import warnings

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

TRIGGER = -12345.0
SLEEP_S = 2.0


class FaultInjected(RuntimeError):
    """Raised by a Fault op in the chosen rank."""


def worker_rank():
    """This process's synkhronos rank if it is a worker, else None (the master)."""
    import synkhronos.session as r
    if not r.IN_WORKER:
        return None
    try:
        return int(json.loads(sys.argv[1])["rank"])
    except Exception:  # pragma: no cover
        return None


def _act(action, where):
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)              # pragma: no cover - not reached
    if action == "fork":
        import synkhronos as synk
        synk.fork(2)                # must raise RuntimeError inside a worker
        raise AssertionError("synk.fork() inside a worker did not raise")  # pragma: no cover
    raise FaultInjected(f"synk-fault injected in rank {worker_rank()} at {where}")


class Fault(Op):
    __props__ = ("action", "rank", "when")

    def __init__(self, action="raise", rank=1, when="perform"):
        assert action in ("raise", "kill", "sleep", "fork") and when in ("perform", "unpickle")
        self.action, self.rank, self.when = action, rank, when

    def make_node(self, x):
        from pytensor.tensor import as_tensor_variable
        x = as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, output_storage):
        (x,) = inputs
        if self.when == "perform" and np.any(x == TRIGGER):
            if self.action == "sleep":
                time.sleep(SLEEP_S)
            elif worker_rank() == self.rank:
                _act(self.action, "perform")
        output_storage[0][0] = np.array(x, copy=True)

    def __setstate__(self, state):
        self.__dict__.update(state)
        if state.get("when") == "unpickle" and worker_rank() == state.get("rank"):
            _act(state["action"], "unpickle")


class Lag(Op):
    """Rank ``rank`` sleeps ``seconds`` before passing its value on (a slow rank)."""
    __props__ = ("rank", "seconds")

    def __init__(self, rank=1, seconds=0.002):
        self.rank, self.seconds = rank, seconds

    def make_node(self, x):
        from pytensor.tensor import as_tensor_variable
        x = as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, output_storage):
        if worker_rank() == self.rank:
            time.sleep(self.seconds)
        output_storage[0][0] = np.array(inputs[0], copy=True)


def _register_jax():
    """JAX conversions of ``Fault`` and ``Lag`` (their ``perform`` as a host callback), so
    that the same faults run on JAX ranks: when this process runs JAX (a JAX rank, or a
    master with ``SYNK_MODE=JAX``)."""
    if not ("jax" in sys.modules or os.environ.get("SYNK_MODE", "").strip().upper() == "JAX"):
        return
    import jax
    from pytensor.link.jax.dispatch import jax_funcify

    def as_callback(op, **kwargs):
        def host(x):
            x = np.asarray(x)
            out = [[None]]
            op.perform(None, [x], out)
            return np.asarray(out[0][0], x.dtype)
        return lambda x: jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    jax_funcify.register(Fault)(as_callback)
    jax_funcify.register(Lag)(as_callback)


class AtExit(Op):
    """In a worker: registers an exit handler that writes ``<SYNK_TEST_EXIT_DIR>/rank<r>``
    and leaves a line in stdout's buffer (not flushed): what a worker's exit must
    still honour."""
    __props__ = ()

    def make_node(self, x):
        from pytensor.tensor import as_tensor_variable
        x = as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, output_storage):
        r = worker_rank()
        if r is not None:
            import atexit
            path = os.path.join(os.environ["SYNK_TEST_EXIT_DIR"], f"rank{r}")
            atexit.register(lambda: open(path, "w").close())
            sys.stdout.write(f"unflushed words of rank {r}\n")   # a pipe: block-buffered
        output_storage[0][0] = np.array(inputs[0], copy=True)


_register_jax()


def quiet():
    """Silence PyTensor's 'Numba will use object mode' warning for Fault."""
    warnings.filterwarnings("ignore", message=".*Numba will use object mode.*")


def with_trigger(values, rank, n):
    """A copy of ``values`` (1-D) with TRIGGER in the first row of ``rank``'s shard."""
    from synkhronos.shards import split
    v = np.array(values, dtype=np.float64, copy=True)
    b = split(len(v), n)
    assert b[rank + 1] > b[rank], "that rank has no rows"
    v[b[rank]] = TRIGGER
    return v


# ------------------------------------------------------------------------------------------
# Start-up faults

_SITECUSTOMIZE = '''
import json, os, sys, time
_spec = os.environ.get("SYNK_TEST_STARTUP_FAULT")
with open("/proc/self/cmdline", "rb") as _fh:
    _server = b"synkhronos.backends.host.forkserver" in _fh.read()
if _spec and _server:
    # the fork server: its workers never run this file; arm each one as it is forked
    if "server" in _spec.split(","):
        os.kill(os.getpid(), 9)

    def _arm():
        w = sys.modules.get("synkhronos.worker")
        if w is None or getattr(w.main, "armed", False):
            return
        inner = w.main

        def main():
            rank = json.loads(sys.argv[1])["rank"]
            for one in _spec.split(","):
                parts = one.split(":")
                if len(parts) < 2 or rank != int(parts[1]):
                    continue
                if parts[0] == "kill":
                    os.kill(os.getpid(), 9)
                elif parts[0] == "raise":
                    sys.modules["pytensor"] = None      # its import in the worker's set-up fails
                elif parts[0] == "sleep":
                    time.sleep(float(parts[2]))
            return inner()
        main.armed = True
        w.main = main
    os.register_at_fork(after_in_child=_arm)
elif _spec:
    try:
        with open("/proc/self/cmdline", "rb") as _fh:
            _argv = _fh.read().split(b"\\0")
        _rank = json.loads(_argv[_argv.index(b"synkhronos.worker") + 1])["rank"]
    except Exception:
        _rank = None
    for _one in _spec.split(","):
        _parts = _one.split(":")
        if _rank is None or len(_parts) < 2 or _rank != int(_parts[1]):
            continue
        if _parts[0] == "kill":
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        elif _parts[0] == "raise":
            os.environ["PYTENSOR_FLAGS"] = "floatX=synk_fault_injected"
        elif _parts[0] == "sleep":
            time.sleep(float(_parts[2]))
'''


def startup_fault_env(tmp_path, spec, forked=True):
    """{env var: value} that makes the workers named in ``spec`` fail at start-up (``kill:R``,
    ``raise:R``, ``sleep:R:S``; ``server``: the fork server dies as it starts), forked by the
    fork server or (``forked=False``) spawned."""
    d = tmp_path / "synk_sitecustomize"
    d.mkdir(exist_ok=True)
    (d / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(d) + (os.pathsep + old if old else ""),
            "SYNK_TEST_STARTUP_FAULT": spec, "SYNK_FORK_SERVER": "1" if forked else "0"}
