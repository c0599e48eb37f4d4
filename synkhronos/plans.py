"""What the master tells the ranks about one call or collective: small frozen records.

They are computed and validated in the master; every rank reads them (debug fingerprints
included) by field."""
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, slots=True)
class ArrayRef:
    """An array the master put where ranks can read it: ``handle`` (None: empty array)."""
    handle: object
    dtype: str
    shape: tuple


@dataclass(frozen=True, slots=True)
class Rows:
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


@dataclass(frozen=True, slots=True)
class CallPlan:
    fid: int
    inputs: tuple                 # ArrayRef per input (scattered, then broadcast)
    rows: Rows
    sel_s: Optional[tuple]        # per-rank batch_s selector, or None
    num_slices: int
    send: Optional[tuple]         # which outputs workers send back (None: all)


@dataclass(frozen=True, slots=True)
class ScatterPlan:
    """Values to split over the ranks along axis 0, each by its own ``Rows``."""
    values: tuple                 # ArrayRef per variable
    rows: tuple                   # Rows per variable


@dataclass(frozen=True, slots=True)
class SetValuePlan:
    rank: int
    values: tuple                 # ArrayRef per variable
    select: Optional[tuple]       # ("range", a, b) or ("index", ArrayRef) or None
