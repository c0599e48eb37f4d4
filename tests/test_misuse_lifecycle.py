"""Misuse over a session's life: a function the workers cannot get, and every entry point
after the session is gone; a clear error, never a hang, a crash or wrong data.

Documented behaviours checked here:

* a function that cannot be pickled fails ``distribute()`` with a TypeError that says so
  (the session stays open, undistributed); an Op the workers cannot import fails it with a
  WorkerError naming every worker;
* after close() (or after a worker died) every entry point raises RuntimeError.

Covered elsewhere and not repeated: fork twice and calls after close for functions and Data
(test_failures)."""
import importlib.util
import sys

import numpy as np
import pytest
import pytensor
import pytensor.tensor as T
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import synkhronos as synk
import synk_testutil as tu

pytestmark = pytest.mark.filterwarnings("ignore:Numba will use object mode")

N = 3


# ==============================================================================================
# Distribute: functions that cannot be pickled, or unpickled by the workers

def test_unpicklable_function_at_distribute(assert_clean):
    class LocalOp(Op):                       # a local class: pickle cannot name it
        __props__ = ()

        def make_node(self, x):
            return Apply(self, [x], [x.type()])

        def perform(self, node, inputs, out):
            out[0][0] = np.array(inputs[0], copy=True)

    try:
        synk.fork(2)
        v = T.vector("v", dtype="float64")
        f = synk.function([v], (T.sum(LocalOp()(v)), "sum"))
        seq = tu.commands_sent()
        with pytest.raises(TypeError, match="could not pickle") as ei:
            synk.distribute()
        assert "importable" in str(ei.value)
        assert tu.commands_sent() == seq, "nothing must reach the workers"
        assert tu.is_open() and not tu.info().distributed   # documented: still open
        with pytest.raises(RuntimeError, match="distribute"):
            f(np.ones(3))
        synk.close()
        assert synk.fork(2) == 2                 # and a new session works
        v = T.vector("v", dtype="float64")
        g = synk.function([v], (T.sum(v), "sum"))
        synk.distribute()
        assert g(np.arange(4.0)) == 6.0
    finally:
        synk.close()
    assert_clean()


_HIDDEN_OP = '''
import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

class HiddenOp(Op):
    __props__ = ()

    def make_node(self, x):
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, out):
        out[0][0] = np.array(inputs[0], copy=True)
'''


def test_op_the_workers_cannot_import(tmp_path, assert_clean):
    """An Op from a module the master loaded from a path the workers do not have: every
    worker fails to unpickle it, and distribute() names them all."""
    path = tmp_path / "synk_hidden_op_mod.py"
    path.write_text(_HIDDEN_OP)
    spec = importlib.util.spec_from_file_location("synk_hidden_op_mod", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["synk_hidden_op_mod"] = mod
    spec.loader.exec_module(mod)
    try:
        synk.fork(N)
        v = T.vector("v", dtype="float64")
        synk.function([v], (T.sum(mod.HiddenOp()(v)), "sum"))
        with pytest.raises(synk.WorkerError) as ei:
            synk.distribute()
        assert ei.value.ranks == [1, 2]
        assert all("synk_hidden_op_mod" in ei.value.errors[r] for r in (1, 2))
        assert "ModuleNotFoundError" in ei.value.errors[1]
        assert tu.is_open()
        synk.close()
    finally:
        sys.modules.pop("synk_hidden_op_mod", None)
        synk.close()
    assert_clean()


# ==============================================================================================
# Everything after close, and after a worker died

def _every_entry_point(f, var, d):
    return {
        "call": lambda: f(np.ones(3)),
        "function": lambda: synk.function([T.vector("q")], T.sum(T.vector("q"))),
        "distribute": synk.distribute,
        "data": lambda: synk.data(np.ones(3)),
        "Data.set_value": lambda: d.set_value(np.ones(5)),
        "Data.set_shape": lambda: d.set_shape((7,)),
        "Data.free_memory": d.free_memory,
        "broadcast": lambda: synk.broadcast(var),
        "scatter": lambda: synk.scatter(var, np.ones(6)),
        "gather": lambda: synk.gather(var),
        "all_gather": lambda: synk.all_gather(var),
        "reduce": lambda: synk.reduce(var),
        "all_reduce": lambda: synk.all_reduce(var),
        "set_value": lambda: synk.set_value(1, var, np.ones(3)),
        "get_value": lambda: synk.get_value(1, var),
        "get_shapes": lambda: synk.get_shapes(var),
        "get_lengths": lambda: synk.get_lengths(var),
    }


@pytest.mark.parametrize("how", ["close", "worker died"])
def test_everything_after_close(how, assert_clean):
    try:
        synk.fork(2)
        v = T.vector("v", dtype="float64")
        w = pytensor.shared(np.zeros(3), name="w")
        f = synk.function([v], [(T.sum(v), "sum"), (T.sum(w), None)])
        synk.distribute()
        d = synk.data(np.ones(3))
        assert f(d)[0] == 3.0
        if how == "close":
            synk.close()
        else:
            tu.kill_rank(1)
            with pytest.raises(synk.WorkerDied):
                synk.all_reduce(w)
        for name, fn in _every_entry_point(f, w, d).items():
            with pytest.raises(RuntimeError, match="fork|closed") as ei:
                fn()
            assert not isinstance(ei.value, (synk.WorkerError, synk.WorkerDied)), name
        assert synk.debug_log() == []
        synk.close()                              # harmless
    finally:
        synk.close()
    assert_clean()
