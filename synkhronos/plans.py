"""What the master tells the ranks about one call or collective: small immutable records.

They are computed and validated in the master; every rank reads them (debug fingerprints
included) by field.  Named tuples: they pickle as fast as plain tuples."""
from typing import NamedTuple, Optional

import numpy as np


class ArrayRef(NamedTuple):
    """An array the master put where ranks can read it: ``handle`` (None: empty array)."""
    handle: object
    dtype: str
    shape: tuple


class Rows(NamedTuple):
    """Which rows of the scattered inputs each rank takes.

    ``kind`` "range": rank r takes rows ``bounds[r]:bounds[r+1]`` (``base`` is the first
    row of the batch); "index": positions ``bounds[r]:bounds[r+1]`` of ``index`` (an
    int64 ``ArrayRef``).  A ``minibatch`` input holds only the batch: its rows are taken
    by position within the batch."""
    kind: str
    bounds: tuple
    base: int = 0
    index: Optional[ArrayRef] = None
    minibatch: tuple = ()


class CallPlan(NamedTuple):
    fid: int
    inputs: tuple                 # ArrayRef per input (scattered, then broadcast)
    rows: Rows
    sel_s: Optional[tuple]        # per-rank batch_s selector, or None
    num_slices: int
    send: Optional[tuple]         # which outputs workers send back (None: all)


def call_to_wire(plan):
    """A ``CallPlan`` as plain tuples: they pickle ~8x faster than named tuples (no class
    lookups), which matters on the per-call path."""
    rows = plan.rows
    idx = None if rows.index is None else tuple(rows.index)
    return (plan.fid, tuple(tuple(r) for r in plan.inputs),
            (rows.kind, rows.bounds, rows.base, idx, rows.minibatch),
            plan.sel_s, plan.num_slices, plan.send)


def call_from_wire(t):
    fid, inputs, (kind, bounds, base, idx, mbs), sel_s, num_slices, send = t
    rows = Rows(kind, bounds, base, None if idx is None else ArrayRef(*idx), mbs)
    return CallPlan(fid, tuple(ArrayRef(*r) for r in inputs), rows, sel_s, num_slices, send)


SMALL_ARRAY = 8192      # bytes: smaller results travel as bytes, larger ones out of band (read in place)


def arrays_to_wire(arrays):
    """A rank's results for the master: small numeric arrays as ``(dtype, shape, bytes)``
    (they pickle ~10x faster than ndarrays), others as they are (None stays None)."""
    return [a if a is None or a.nbytes > SMALL_ARRAY or a.dtype.kind not in "biufc"
            else (a.dtype.str, a.shape, a.tobytes()) for a in arrays]


def arrays_from_wire(items):
    """Inverse of ``arrays_to_wire``: read-only arrays over the received bytes."""
    return [x if x is None or isinstance(x, np.ndarray) else np.frombuffer(x[2], x[0]).reshape(x[1])
            for x in items]


class ScatterPlan(NamedTuple):
    """Values to split over the ranks along axis 0, each by its own ``Rows``."""
    values: tuple                 # ArrayRef per variable
    rows: tuple                   # Rows per variable


class SetValuePlan(NamedTuple):
    rank: int
    values: tuple                 # ArrayRef per variable
    select: Optional[tuple]       # ("range", a, b) or ("index", ArrayRef) or None


class Need(NamedTuple):
    """Data a command's ranks read from a master's buffer: every rank all of ``ref``
    (``rows`` None), or rank r its rows of it under ``rows``; only ``ranks`` when given.
    What a control plane that spans hosts ships to each host (``backends.mpi``)."""
    ref: ArrayRef
    rows: Optional[Rows] = None
    minibatch: bool = False
    ranks: Optional[tuple] = None


def call_needs(plan, n_scatter):
    """What the ranks of a call read: their rows of the scattered inputs, all of the others."""
    needs = []
    rows = plan.rows
    if rows.index is not None:
        needs.append(Need(rows.index))
    for i, ref in enumerate(plan.inputs):
        if ref.handle is None:
            continue
        if i < n_scatter:
            needs.append(Need(ref, rows, rows.minibatch[i]))
        else:
            needs.append(Need(ref))
    return tuple(needs)


def scatter_needs(plan):
    needs = []
    for ref, rows in zip(plan.values, plan.rows):
        if rows.index is not None and Need(rows.index) not in needs:
            needs.append(Need(rows.index))
        if ref.handle is not None:
            needs.append(Need(ref, rows))
    return tuple(needs)


def set_value_needs(plan):
    needs = []
    if plan.select is not None and plan.select[0] == "index":
        needs.append(Need(plan.select[1], ranks=(plan.rank,)))
    needs.extend(Need(ref, ranks=(plan.rank,)) for ref in plan.values if ref.handle is not None)
    return tuple(needs)
