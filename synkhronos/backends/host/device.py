"""The ``cpu`` device: ranks are CPU cores running PyTensor's default backend (numba).

Each process gets ``cores // ranks on this host`` threads (at least one) for BLAS and
numba; the master's own limits are undone when the session closes."""
import os

import numpy as np
from threadpoolctl import threadpool_limits   # (at import: it sets KMP_DUPLICATE_LIB_OK, and workers'
                                              # environment must not change between sessions: forked.py)

from ... import generators
from ...compiling import compiling

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS",
               "NUMBA_NUM_THREADS")


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def restore_env(saved):
    """Put back environment variables saved as ``{name: value or None (unset)}``; -> None."""
    for k, v in (saved or {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return None


class ThreadLimits:
    """BLAS and numba thread limits of the master process (and the variables libraries
    loaded later read), undone by ``release``."""

    def __init__(self, threads):
        self.threads = threads
        self._limits = self._saved_env = self._numba_threads = None

    def apply(self):
        self._saved_env = {v: os.environ.get(v) for v in THREAD_VARS}
        os.environ.update({v: str(self.threads) for v in THREAD_VARS if v != "NUMBA_NUM_THREADS"})
        # (numba refuses a change of NUMBA_NUM_THREADS once its pool exists: set below)
        self._limits = threadpool_limits(limits=self.threads)
        try:
            import numba
            self._numba_threads = numba.get_num_threads()
            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        except Exception:  # numba missing or its pool not configurable: nothing to limit
            self._numba_threads = None

    def release(self):
        if self._limits is not None:
            self._limits.restore_original_limits()
            self._limits = None
        self._saved_env = restore_env(self._saved_env)
        if self._numba_threads is not None:
            try:
                import numba
                numba.set_num_threads(self._numba_threads)
            except Exception:
                pass
            self._numba_threads = None


class CpuDevice:
    """Ranks are CPU cores; each process gets ``cores // local_n`` threads (at least one)."""

    kind = "cpu"
    placement = "host"

    @staticmethod
    def count():
        return usable_cores()

    def __init__(self, n, local_n=None):
        self.n = n
        self.cores = usable_cores()
        self.local_n = local_n or n          # the ranks that share this host's cores
        self.threads = max(1, self.cores // self.local_n)
        self._limits = None

    def config(self):
        return {"kind": self.kind, "local_n": self.local_n}

    # ---- processes -------------------------------------------------------------------------
    def worker_env(self, rank):
        return {v: str(self.threads) for v in THREAD_VARS}

    def init_master(self, rank, close_session):
        self._limits = ThreadLimits(self.threads)
        self._limits.apply()

    def release_master(self):
        if self._limits is not None:
            self._limits.release()
            self._limits = None

    def init_worker(self, rank):
        pass

    # ---- compiling -------------------------------------------------------------------------
    def compile(self, inputs, outputs, givens=None, **kwargs):
        import pytensor
        with compiling():
            fn = pytensor.function(inputs, outputs, givens=givens, **kwargs)
        fn.trust_input = True
        return fn

    def adopt(self, fn):
        fn.trust_input = True
        return fn

    # ---- values ----------------------------------------------------------------------------
    def get(self, var):
        return var.container.storage[0]

    def set(self, var, value):
        var.container.storage[0] = value

    def generator_state(self, var):
        return generators.state_of(var.container.storage[0])

    def set_generator_state(self, var, state):
        var.container.storage[0] = generators.generator(state)

    def to_host(self, arr):
        return np.asarray(arr)

    def to_device(self, arr):
        return arr

    def call_inputs(self, arrays):
        return list(arrays)

    def wait(self, arrays, reads=0):
        pass

    def explain(self, exc, rank, what, inputs):
        return None

    def combine(self, mode, parts, weights=None):
        from ...reductions import combine
        return combine(mode, parts, weights)

    def describe(self):
        if self.local_n != self.n:
            return f"{self.n} CPU ranks, {self.local_n} on this host's {self.cores} usable cores, " \
                   f"{self.threads} thread(s) each"
        return f"{self.n} CPU ranks on {self.cores} usable cores, {self.threads} thread(s) each"
