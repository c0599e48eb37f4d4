"""Debug mode (``synk.fork(debug=True)`` or ``SYNK_DEBUG=1``): fingerprint every command.

Each rank records, before it acts, the command's sequence number, its kind and, for every
variable or input it touches, the dtype and shape it holds.  The master compares the
fingerprints of all ranks and raises ``DebugMismatch`` naming the first rank that differs
from the master.  Fingerprints are kept in ``synk.debug_log()``."""
import os

import numpy as np

from .errors import SynkError

_EQUAL_SHAPES = ("all_reduce", "reduce")


class DebugMismatch(SynkError):
    """Ranks disagreed on what a command operates on (dtype, or shape where it must match)."""


def enabled(flag=None):
    if flag is not None:
        return bool(flag)
    return os.environ.get("SYNK_DEBUG", "").lower() not in ("", "0", "false", "no")


def fingerprint(seq, name, args, shareds):
    """What this rank is about to operate on, as a comparable tuple."""
    if name == "coll":
        op, vids = args[0], args[1]
        items = []
        for v in vids:
            val = shareds[v].container.storage[0]
            items.append((str(np.dtype(val.dtype)), tuple(np.shape(val))))
        return (seq, name, op, tuple(items))
    if name == "call":
        fid, inputs = args[0][0], args[0][1]          # a CallPlan on the wire: (fid, ArrayRefs, …)
        return (seq, name, fid, tuple((np.dtype(r[1]).name, tuple(r[2][1:])) for r in inputs))
    return (seq, name, None, ())


def compare(master_rank, fps):
    """Raise DebugMismatch for the first rank whose fingerprint disagrees with the master's."""
    ref = fps[master_rank]
    for rank in sorted(fps):
        fp = fps[rank]
        if rank == master_rank or fp is None:
            continue
        same = fp[:3] == ref[:3] and len(fp[3]) == len(ref[3]) and all(
            a[0] == b[0] and (a[1] == b[1] or ref[2] not in _EQUAL_SHAPES)
            for a, b in zip(fp[3], ref[3]))
        if not same:
            raise DebugMismatch(
                f"synkhronos debug: first mismatch at command #{ref[0]} ({ref[1]} {ref[2]}): "
                f"rank {master_rank} (master) has {ref[3]}, rank {rank} has {fp[3]}"
                + ("" if fp[:3] == ref[:3] else f" (rank {rank} saw command {fp[:3]})"))
