"""synkhronos: data-parallel PyTensor (Theano-style) functions over worker processes.

    import synkhronos as synk
    synk.fork()                       # one process per device (CPU cores here)
    f = synk.function([x], outputs=loss, bcast_inputs=[y])
    synk.distribute()
    r = f(synk.data(x_dat), synk.data(y_dat))
"""
import sys as _sys

from .session import fork, close
from .diagnostics import debug_log, session_info, flight_report
from .debug import DebugMismatch
from .data import data, Data
from .function import function, distribute, Function
from .errors import (SynkError, WorkerError, WorkerDied, WorkerStopped, StallTimeout, RankLost,
                     ForeignSession, OutOfRange, BadArgument, DeviceMemoryError)
from .collectives import (broadcast, scatter, gather, all_gather, reduce, all_reduce,
                          set_value, get_value, get_lengths, get_shapes)
from .backends import get_n_gpu
from .checkpoint import save, load, CheckpointError

_sys.setrecursionlimit(max(_sys.getrecursionlimit(), 50000))


def __getattr__(name):
    """``synkhronos.ops`` (in-graph collectives) imports PyTensor: loaded on first use."""
    if name == "ops":
        import importlib
        return importlib.import_module(".ops", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__version__ = "0.1.0"
__all__ = ["fork", "close", "data", "Data", "function", "distribute", "Function",
           "broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
           "set_value", "get_value", "get_lengths", "get_shapes",
           "SynkError", "WorkerError", "WorkerDied", "WorkerStopped", "StallTimeout", "RankLost",
           "ForeignSession", "OutOfRange", "BadArgument", "DeviceMemoryError", "DebugMismatch", "debug_log",
           "session_info", "flight_report",
           "get_n_gpu", "save", "load", "CheckpointError"]
