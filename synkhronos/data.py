"""``Data``: arrays that every rank reads without copying (shared memory on one host).

The master owns each Data's buffer (from the control plane); ranks attach lazily the first
time a command names it and drop the mapping when the master tells them it is gone
(piggybacked on the next command), so resizing, freeing or dropping a Data costs no extra
round trip."""
import math
import operator
import os
import weakref

import numpy as np

from .plans import ArrayRef
from .session import get_session


def _check_oversize(oversize):
    if isinstance(oversize, bool) or not isinstance(oversize, (int, float, np.integer, np.floating)) \
            or not 1 <= float(oversize) <= 2:
        raise ValueError(f"param 'oversize' must be a number in [1, 2], got {oversize!r}")
    return float(oversize)


def condition(value, dtype, ndim, force_cast=False):
    """Convert ``value`` to an array of ``dtype`` and ``ndim`` as Data.set_value would.

    Arrays (and numpy scalars) are accepted when their dtype casts safely to ``dtype``
    (uint8 -> int32 yes, float64 -> float32 no).  Python lists and scalars carry no precision
    of their own, so they are accepted when they cast within the same kind (float list ->
    float32).  ``force_cast=True`` converts anything numpy can convert."""
    dtype = np.dtype(dtype)
    if force_cast:
        arr = np.asarray(value, dtype=dtype)
    else:
        typed = isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "__array_interface__")
        arr = np.asarray(value)
        if arr.dtype != dtype:
            ok = np.can_cast(arr.dtype, dtype, "safe") or (
                not typed and arr.dtype.kind in "biuf" and dtype.kind in "iuf"
                and np.can_cast(arr.dtype, dtype, "same_kind"))
            if not typed and arr.dtype.kind in "iu" and dtype.kind in "iuf":
                ok = True
                if dtype.kind in "iu" and arr.size:
                    info = np.iinfo(dtype)
                    ok = info.min <= arr.min() and arr.max() <= info.max
            if not ok:
                raise TypeError(
                    f"data of dtype {arr.dtype} cannot be safely cast to {dtype}; convert it "
                    f"first or pass force_cast=True")
            arr = arr.astype(dtype)
    if arr.ndim != ndim:
        raise TypeError(f"wrong number of dimensions: expected {ndim}, got {arr.ndim} (shape {arr.shape})")
    return arr


def _release(rt_ref, buf, pid):
    """Finalizer of a dropped Data: free its buffer, tell the workers on the next command.
    Never in a process forked from the session's: the buffer is the parent's."""
    if os.getpid() != pid:
        return
    buf.release()
    session = rt_ref()
    if session is not None and not session.closed:
        session.forget.append(buf.handle)


class Data:
    """Shared-memory array input for synkhronos functions and collectives.

    Behaves like a numpy array for reading and writing (indexing, ``len``, ``shape`` …);
    ``set_value``/``set_shape``/``set_length`` resize it, reusing the allocation whenever the
    new size fits.  Create it with ``synk.data(...)``."""

    def __init__(self, dtype, ndim, minibatch=False, name=None, _session=None, _scratch=False):
        session = _session or get_session()
        self._scratch = _scratch          # synkhronos' own staging: nothing to keep after the session
        self._session_ref = weakref.ref(session)
        self.ID = session.n_data
        session.n_data += 1
        self._dtype = np.dtype(dtype)
        if not isinstance(ndim, (int, np.integer)) or ndim < 0:
            raise ValueError(f"ndim must be a non-negative int, got {ndim!r}")
        self._ndim = int(ndim)
        self._minibatch = bool(minibatch)
        self._name = name
        self._buf = None
        self._alloc = 0          # items allocated
        self._finalizer = None
        self._arr = np.empty((0,) * self._ndim, self._dtype)

    # ---- numpy-like surface --------------------------------------------------------------
    dtype = property(lambda self: self._dtype, doc="numpy dtype of the data")
    ndim = property(lambda self: self._ndim, doc="number of dimensions (fixed)")
    shape = property(lambda self: self._arr.shape, doc="current shape")
    size = property(lambda self: self._arr.size, doc="current number of items")
    alloc_size = property(lambda self: self._alloc, doc="items allocated in shared memory (>= size)")
    data = property(lambda self: self._arr, doc="the numpy view of the shared memory")
    name = property(lambda self: self._name, doc="name given at creation (may be None)")
    minibatch = property(lambda self: self._minibatch,
                         doc="whether rows are taken by position within a call's batch")

    def __getitem__(self, k):
        return self._arr[k]

    def __setitem__(self, k, v):
        self._arr[k] = v

    def __len__(self):
        if self._ndim == 0:
            raise TypeError("len() of a 0-d Data")
        return len(self._arr)

    def __array__(self, dtype=None, copy=None):
        if copy:
            return np.array(self._arr, dtype=dtype)
        return self._arr if dtype is None else self._arr.astype(dtype, copy=False)

    def __repr__(self):
        nm = f" {self._name!r}" if self._name else ""
        return f"<synk.Data{nm} shape={self.shape} dtype={self._dtype} alloc={self._alloc}>"

    # ---- values and shapes --------------------------------------------------------------
    def condition_data(self, input_data, force_cast=False):
        """The array ``set_value`` would store for ``input_data`` (a dry run)."""
        return condition(input_data, self._dtype, self._ndim, force_cast)

    def set_value(self, input_data, force_cast=False, oversize=1):
        """Write ``input_data``, resizing (and reallocating only if it does not fit)."""
        arr = condition(input_data, self._dtype, self._ndim, force_cast)
        self._reshape(arr.shape, oversize, keep=False)
        np.copyto(self._arr, arr)

    def set_shape(self, shape, oversize=1):
        """Change the shape; the allocation is reused when the new size fits.

        Rows are kept when only the length changes; after a reallocation that changes
        other dimensions the contents are zero."""
        try:
            shape = tuple(operator.index(s) for s in shape)
        except TypeError:
            raise TypeError(f"shape must be a sequence of integers, got {shape!r}") from None
        if len(shape) != self._ndim:
            raise ValueError(f"cannot change number of dimensions: expected {self._ndim}, got {len(shape)}")
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        self._reshape(shape, oversize, keep=True)

    def set_length(self, length, oversize=1):
        """Change the length (axis 0), keeping the other dimensions and the leading rows."""
        if self._ndim == 0:
            raise ValueError("a 0-d Data has no length")
        try:
            length = operator.index(length)
        except TypeError:
            raise TypeError(f"length must be an integer, got {length!r}") from None
        if length < 0:
            raise ValueError(f"length must be a non-negative integer, got {length}")
        self.set_shape((length,) + self.shape[1:], oversize)

    def free_memory(self):
        """Release the shared memory everywhere; the Data becomes empty (shape of zeros)."""
        self._check_open()
        self._drop_buffer()
        self._alloc = 0
        self._arr = np.empty((0,) * self._ndim, self._dtype)

    # ---- internals ------------------------------------------------------------------------
    def _check_open(self):
        session = self._session_ref()
        if session is None or session.closed:
            raise RuntimeError("this Data belongs to a closed synkhronos session")
        session.check_usable()
        return session

    def _reshape(self, shape, oversize, keep):
        oversize = _check_oversize(oversize)
        session = self._check_open()
        size = math.prod(shape)
        if tuple(shape) == self._arr.shape and (self._buf is not None or size == 0):
            return
        if size <= self._alloc:
            self._arr = self._buf.array(self._dtype, shape) if size else np.empty(shape, self._dtype)
            return
        old = self._arr
        n_items = max(size, int(size * oversize))
        buf = session.me.control.alloc(n_items * self._dtype.itemsize, kept=not self._scratch)
        new = buf.array(self._dtype, shape)
        if keep and old.ndim and old.shape[1:] == shape[1:]:
            rows = min(len(old), shape[0])
            new[:rows] = old[:rows]
        self._drop_buffer()
        self._buf, self._alloc, self._arr = buf, n_items, new
        self._finalizer = weakref.finalize(self, _release, self._session_ref, buf, os.getpid())

    def _drop_buffer(self):
        if self._finalizer is not None:
            self._finalizer()          # frees it and queues the handle for the workers
            self._finalizer = None
        self._buf = None

    def _ref(self):
        """What a rank needs to read this Data: an ``ArrayRef``."""
        arr = self._arr
        return ArrayRef(self._buf.handle if (self._buf is not None and arr.size) else None, arr.dtype.str,
                        arr.shape)


# ---- what the runtime reads of a Data (functions and collectives; not for users) -----------


def array_ref(d):
    """What a rank needs to read ``d``: an ``ArrayRef``."""
    return d._ref()


def owner(d):
    """The session ``d`` belongs to (None once it is gone)."""
    return d._session_ref()


def resize(d, shape, oversize, keep):
    """Give ``d`` the shape ``shape`` (a new buffer only when it does not fit; ``keep``
    copies the rows that stay)."""
    d._reshape(shape, oversize, keep)


def plan_key(d):
    """What a call's plan depends on of ``d``: its buffer, shape and minibatch flag."""
    return (d._buf.handle if d._buf is not None else None, d._arr.shape, d._minibatch)


def data(value=None, var=None, dtype=None, ndim=None, shape=None, minibatch=False,
         force_cast=False, oversize=1, name=None):
    """Make a ``Data`` (shared-memory array) for function inputs and collectives.

    dtype and ndim come from ``var`` (a PyTensor variable), else from ``dtype``/``ndim`` (or
    ``len(shape)``), else from ``value``.  ``value`` fills it; ``shape`` alone allocates
    zeros.  ``oversize`` in [1, 2] reserves extra room so later growth needs no new segment."""
    get_session()
    _check_oversize(oversize)
    if var is not None:
        vtype = getattr(var, "type", None)
        if vtype is None or not hasattr(vtype, "dtype") or not hasattr(vtype, "ndim"):
            raise TypeError(f"var must be a PyTensor tensor variable, got {var!r}")
        if dtype is not None and np.dtype(dtype) != np.dtype(vtype.dtype):
            raise ValueError(f"dtype={dtype!r} conflicts with var's dtype {vtype.dtype}")
        if ndim is not None and ndim != vtype.ndim:
            raise ValueError(f"ndim={ndim!r} conflicts with var's ndim {vtype.ndim}")
        dtype, ndim = vtype.dtype, vtype.ndim
        if name is None:
            name = var.name
    if ndim is None and shape is not None:
        ndim = len(shape)
    if value is not None and (dtype is None or ndim is None):
        arr = np.asarray(value)
        dtype = arr.dtype if dtype is None else dtype
        ndim = arr.ndim if ndim is None else ndim
    if dtype is None or ndim is None:
        raise TypeError("Must provide either 1) var, 2) a value with dtype and ndim, or "
                        "3) dtype and either ndim or shape.")
    d = Data(dtype, ndim, minibatch=minibatch, name=name)
    if value is not None:
        d.set_value(value, force_cast=force_cast, oversize=oversize)
        if shape is not None and tuple(shape) != d.shape:
            raise ValueError(f"shape {tuple(shape)} does not match the value's shape {d.shape}")
    elif shape is not None:
        d.set_shape(shape, oversize)
    return d
